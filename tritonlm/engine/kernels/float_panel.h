// The float32 panel kernel's inner call (float_panel.cpp), shared with the weight-only int8
// kernel's prefill path (weight_only_int8.cpp), which widens its int8 panels into float ones
// a few at a time and multiplies them here.
//
//   panel_vectors()  whether this build has a vector panel kernel (AVX-512 or AVX2); panel_rows
//                    writes nothing where it does not
//   panel_rows(x, rows, in, w, np, bias, y, out, n0)
//                    y[m, n0 + c] = sum over k of x[m, k] * w[c / 16][k][c % 16] (+ bias[n0 + c])
//                    for every row m < rows and channel c < 16 np with n0 + c < out: x [rows, in]
//                    (row stride in), w np panels [in, 16] one after another, y row stride out.
//                    One thread; a row's bits do not depend on the other rows.
//   panels_per_task(rows)
//                    how many panels one task of a parallel loop should give panel_rows: its
//                    widest tile at that row count

#pragma once

#include <cstdint>

namespace tritonlm_panel {

constexpr int64_t kLanes = 16;  // output channels in a panel: one zmm of float32

bool panel_vectors();

void panel_rows(const float* x, int64_t rows, int64_t in, const float* w, int64_t np, const float* bias, float* y,
                int64_t out, int64_t n0);

int64_t panels_per_task(int64_t rows);

}  // namespace tritonlm_panel
