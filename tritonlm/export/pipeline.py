"""`tritonlm export`: load a model, export and verify each artifact, write a Triton model
repository around them.

Nothing is written into the repository until every artifact passed verification:
all model folders are built in a staging folder beside the repository, then moved in
one by one (each move a rename). A failure leaves the repository as it was.

Re-running with the same model and options reuses what is already there and verified:
each artifact folder holds `export.json` with a fingerprint of the model source, the
export options that shape the artifact and the exporter's own code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonlm.export.repository import (
    FORMATS,
    NATIVE,
    BatchingOptions,
    artifact_kind,
    default_kv_cache_bytes,
    forward_config,
    forward_model_name,
    write_config,
    write_generate_config,
)

log = logging.getLogger(__name__)

ALL_FORMATS = list(FORMATS)
# family -> the forward formats whose export is verified for it (a tiny model of each exports
# and verifies in tests/unit/export/test_wrapper.py); every format a family lacks here is
# skipped by default and refused when named, with its reason from FORWARD_REFUSED
FORWARD_FORMATS: dict[str, tuple[str, ...]] = {
    family: tuple(ALL_FORMATS)
    for family in ("gpt2", "llama", "qwen2", "qwen3", "mistral", "ministral", "phi3", "granite", "smollm3", "olmo2", "glm", "glm4",
                   "gemma", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")
}
# family -> format -> why its export is not done (the message names it)
FORWARD_REFUSED: dict[str, dict[str, str]] = {}
STAMP = "export.json"
VERIFY_SUFFIX = ".verify.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Files a model repository may hold beside model folders.
ALLOWED_REPO_FILES = re.compile(r"^(README.*|\..*|.*\.md)$", re.IGNORECASE)


class ExportError(RuntimeError):
    """The export cannot proceed; one line saying what was wrong and what to do."""


@dataclass
class ExportOptions:
    model: str
    name: str | None = None
    repo: Path = Path("model_repository")
    formats: list[str] | None = None  # None: those of default_formats the model's family exports
    default_formats: list[str] = field(default_factory=lambda: list(ALL_FORMATS))
    draft: str | None = None
    max_context: int | None = None
    device: str = "cpu"
    runtime: str = "auto"  # auto | native | python (forward models)
    generate_runtime: str = "torch"  # runtime parameter of the generation entry: torch | onnx
    max_queue_delay_us: int = 5000
    max_batch_size: int = 16
    instances: int = 1
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    force: bool = False
    verify_seed: int = 0


@dataclass
class ArtifactResult:
    fmt: str
    model_name: str
    path: str  # relative to the repository
    size_bytes: int
    seconds: float
    reused: bool
    max_abs_logit_diff: float
    top1_agreement: float


@dataclass
class ExportResult:
    repo: Path
    name: str
    runtime: str
    artifacts: list[ArtifactResult]
    models: list[str]  # model folders written or refreshed

    def table(self) -> str:
        rows = [f"{'format':<12} {'model':<28} {'size':>10} {'max|dlogit|':>12} {'top-1':>6} {'time':>8}"]
        for a in self.artifacts:
            how = "reused" if a.reused else f"{a.seconds:.1f} s"
            rows.append(
                f"{a.fmt:<12} {a.model_name:<28} {a.size_bytes / 1e6:>8.1f}MB {a.max_abs_logit_diff:>12.3g} "
                f"{a.top1_agreement:>6.3f} {how:>8}"
            )
        return "\n".join(rows)


class Progress:
    def __init__(self, out=print):
        self.out = out
        self.t0 = time.monotonic()

    def step(self, text: str) -> "_Step":
        return _Step(self, text)


class _Step:
    def __init__(self, progress: Progress, text: str):
        self.p, self.text = progress, text

    def __enter__(self):
        self.start = time.monotonic()
        self.p.out(f"{self.text} ...")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.p.out(f"  done in {time.monotonic() - self.start:.1f} s")
        return False


# ---- checks before anything heavy ----------------------------------------------------------

def parse_formats(text: str | list[str]) -> list[str]:
    """The forward formats named ("all": every one; "none": no forward model, the generation
    model alone)."""
    items = text if isinstance(text, list) else [x.strip() for x in text.split(",")]
    items = [x for x in items if x]
    if not items:
        raise ExportError(f"--formats is empty; choose from {','.join(ALL_FORMATS)}, or none")
    if "none" in (x.lower() for x in items):
        if len(items) > 1:
            raise ExportError(f"--formats: 'none' (the generation model alone) cannot be combined with {items}")
        return []
    aliases = {"int8": "onnx-int8", "fp16": "onnx-fp16", "ts": "torchscript", "onnx_int8": "onnx-int8",
               "onnx_fp16": "onnx-fp16", "all": "all"}
    out: list[str] = []
    for x in items:
        x = aliases.get(x.lower(), x.lower())
        if x == "all":
            out += [f for f in ALL_FORMATS if f not in out]
            continue
        if x not in FORMATS:
            raise ExportError(f"unknown format {x!r} in --formats; choose from {','.join(ALL_FORMATS)}")
        if x not in out:
            out.append(x)
    return out


def check_repo(repo: Path) -> None:
    """The repository folder must be new, empty, or a model repository (model folders,
    READMEs, hidden files) that we can write into."""
    if repo.exists():
        if not repo.is_dir():
            raise ExportError(f"--repo {repo} is a file, not a folder: pass a folder for the model repository")
        strangers = []
        for entry in sorted(repo.iterdir()):
            if entry.is_dir() and (entry / "config.pbtxt").is_file():
                continue
            if entry.is_file() and ALLOWED_REPO_FILES.match(entry.name):
                continue
            if entry.name.startswith("."):
                continue
            strangers.append(entry.name + ("/" if entry.is_dir() else ""))
        if strangers:
            shown = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
            raise ExportError(
                f"--repo {repo} holds {shown}, which is not a Triton model (no config.pbtxt): "
                "pass a new or empty folder, or an existing model repository"
            )
        if not os.access(repo, os.W_OK | os.X_OK):
            raise ExportError(f"--repo {repo} is not writable: pass a folder you can write to, or fix its permissions")
    parent = _existing_parent(repo.parent if repo.exists() else repo)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(
            f"cannot write {repo}: {parent} is not writable; pass a --repo in a folder you can write to"
        )


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def native_backends_present(formats: list[str], backend_dirs: list[Path] | None = None) -> tuple[bool, str]:
    """Whether the server's backend directory has Triton's native backends for `formats`."""
    if backend_dirs is None:
        from tritonlm.paths import BACKEND_DIR

        backend_dirs = [BACKEND_DIR, Path("/opt/tritonserver/backends")]
    needed = sorted({NATIVE[artifact_kind(f)][1] for f in formats})
    missing = [b for b in needed if not any((d / b).is_dir() for d in backend_dirs)]
    if missing:
        return False, f"no {', '.join(missing)} backend in {backend_dirs[0]}"
    return True, f"{', '.join(needed)} backend(s) found"


# ---- fingerprints --------------------------------------------------------------------------

_CODE_FILES = ("wrapper.py", "onnx_export.py", "torchscript_export.py", "verify.py")


def code_version() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _CODE_FILES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def artifact_fingerprint(model_fp: str, fmt: str) -> str:
    h = hashlib.sha256(f"{model_fp}|{fmt}|{code_version()}".encode())
    return h.hexdigest()[:24]


def _read_stamp(version_dir: Path) -> dict | None:
    try:
        return json.loads((version_dir / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _reusable(existing_model_dir: Path, fingerprint: str, files: list[str]) -> bool:
    stamp = _read_stamp(existing_model_dir / "1")
    return bool(
        stamp and stamp.get("fingerprint") == fingerprint and stamp.get("passed", True)
        and all((existing_model_dir / "1" / f).exists() for f in files)
    )


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a folder by hard links where the file system allows (instant, no extra space)."""
    def link_or_copy(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)
    shutil.copytree(src, dst, copy_function=link_or_copy)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- the export ----------------------------------------------------------------------------

def export(opts: ExportOptions, out=print) -> ExportResult:
    from tritonlm.models.loading import ModelLoadError, load_model

    progress = Progress(out)
    asked = opts.formats is not None  # formats named: refused, not skipped, where the family has none
    formats = [] if opts.formats == [] else parse_formats(opts.formats if asked else opts.default_formats)  # []: none
    repo = Path(opts.repo)
    _check_options(opts)
    check_repo(repo)
    if opts.name is not None and not NAME_RE.match(opts.name):
        raise ExportError(f"--name {opts.name!r}: use letters, digits, '-', '_' or '.' (it names Triton models)")

    runtime = opts.runtime
    if runtime == "auto":
        ok, why = native_backends_present(formats)
        runtime = "native" if ok else "python"
        out(f"runtime: {runtime} ({why}; pass --runtime native|python to choose)")
    else:
        out(f"runtime: {runtime}")

    with progress.step(f"loading {opts.model}"):
        try:
            model, tok, info = load_model(opts.model, progress=lambda s: out("  " + s))
        except ModelLoadError as e:
            raise ExportError(str(e)) from None
    name = opts.name or info.name
    formats = _family_formats(info.architecture, formats, asked, out, model.config)
    from tritonlm.engine.model_shape import ModelShape

    spec = ModelShape.from_hf_config(model.config)
    max_context = opts.max_context or spec.max_positions
    if max_context > spec.max_positions:
        raise ExportError(
            f"--max-context {max_context} is beyond what {opts.model} supports ({spec.max_positions} positions): "
            f"use at most {spec.max_positions}"
        )

    draft = None
    if opts.draft:
        with progress.step(f"loading draft {opts.draft}"):
            try:
                dmodel, dtok, dinfo = load_model(opts.draft, progress=lambda s: out("  " + s))
            except ModelLoadError as e:
                raise ExportError(f"--draft: {e}") from None
        _check_same_tokenizer(tok, dtok, opts.model, opts.draft)
        dspec = ModelShape.from_hf_config(dmodel.config)
        if max_context > dspec.max_positions:
            raise ExportError(
                f"--max-context {max_context} is beyond the draft {opts.draft}'s {dspec.max_positions} positions: "
                f"use at most {dspec.max_positions}"
            )
        draft = (dmodel, dtok, dinfo, dspec)

    batching = BatchingOptions(
        max_batch_size=opts.max_batch_size, max_queue_delay_us=opts.max_queue_delay_us,
        instances=opts.instances, device=opts.device,
    )
    # Staged beside the repository (same file system, so the final moves are renames).
    staging_root = _existing_parent(repo.absolute().parent)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.export-", dir=staging_root))
    except OSError as e:
        raise ExportError(f"cannot write next to {repo} ({e.strerror or e}): pass a --repo in a folder you can write to") from None
    try:
        artifacts = _write_forward_models(staging, repo, name, formats, model, info, spec, runtime, batching, opts, progress, out)
        models = [a.model_name for a in artifacts]
        onnx_name = forward_model_name(name, "onnx")
        onnx_rel = None
        if "onnx" in formats or _reusable(repo / onnx_name, artifact_fingerprint(info.fingerprint, "onnx"), ["model.onnx"]):
            onnx_rel = f"../{onnx_name}/1/model.onnx"  # exported now, or earlier from the same model
        if opts.generate_runtime == "onnx" and onnx_rel is None:
            raise ExportError("--generate-runtime onnx needs the onnx format: add onnx to --formats")
        draft_rel = None
        if draft is not None:
            dmodel, dtok, dinfo, dspec = draft
            draft_name = f"{name}_draft"
            _write_hf(staging, repo, draft_name, dmodel, dtok, dinfo, progress, out)
            write_generate_config(
                staging / draft_name, max_context=max_context, device=opts.device,
                kv_cache_bytes=default_kv_cache_bytes(dspec, max_context, sequences=1),
                extra_parameters=None,
            )
            draft_rel = f"../{draft_name}/1/hf"
            models.append(draft_name)
        _write_hf(staging, repo, name, model, tok, info, progress, out)
        kv_bytes = opts.kv_cache_bytes
        if kv_bytes is None and opts.kv_cache_fraction is None:
            kv_bytes = default_kv_cache_bytes(spec, max_context)
        write_generate_config(
            staging / name,
            max_context=max_context,
            runtime=opts.generate_runtime,
            onnx_model=onnx_rel,
            kv_cache_bytes=kv_bytes,
            kv_cache_fraction=opts.kv_cache_fraction,
            draft_model=draft_rel,
            device=opts.device,
            instances=opts.instances,  # each instance owns an engine and its own KV budget
        )
        models.append(name)
        with progress.step(f"moving {len(models)} model folder(s) into {repo}"):
            _commit(staging, repo, models)
    except OSError as e:
        raise ExportError(f"writing the model repository failed: {e.strerror or e} ({e.filename or repo}); "
                          "check free disk space and permissions") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = ExportResult(repo=repo, name=name, runtime=runtime, artifacts=artifacts, models=models)
    out(result.table())
    out(f"model repository {repo}: {', '.join(sorted(models))}")
    return result


def _family_formats(family: str, formats: list[str], asked: bool, out, config=None) -> list[str]:
    """The forward formats to write for `family`: those of `formats` whose export is verified
    for it (none for a length-dependent RoPE); the others skipped with a message, or, when
    asked for by name, an ExportError naming the family, the formats and why."""
    from tritonlm.engine.runners.families import LENGTH_ROPE_TYPES, family_name, rope_parameters, rope_tables

    verified = FORWARD_FORMATS.get(family, ())
    reasons = FORWARD_REFUSED.get(family, {})
    plain = config is None or family == "gpt2" or rope_tables(config)  # no length-dependent RoPE there
    rope_type = "default" if plain else rope_parameters(config)[0]
    if rope_type in LENGTH_ROPE_TYPES:  # a traced graph keeps the branch of the length it was traced at
        verified = ()
        reasons = dict.fromkeys(ALL_FORMATS, f"its {rope_type} RoPE changes its tables with the sequence's length, "
                                             "which a traced graph cannot follow")
    missing = [f for f in formats if f not in verified]
    if not missing:
        return formats
    why = "; ".join(dict.fromkeys(f"{f}: {reasons[f]}" for f in missing if f in reasons))
    what = (f"{', '.join(missing)} forward-model export is not supported for {family_name(family)} ({family})"
            + (f" ({why})" if why else ""))
    if asked:
        has = ", ".join(verified) or "none"
        raise ExportError(f"--formats: {what}; its verified formats: {has}. Leave {', '.join(missing)} out of "
                          "--formats, or pass --formats none to export the generation model alone")
    kept = [f for f in formats if f in verified]
    out(f"skipping {what}: exporting " + (f"{', '.join(kept)} and the generation model" if kept
                                          else "the generation model alone"))
    return kept


def _check_options(opts: ExportOptions) -> None:
    if opts.max_context is not None and opts.max_context < 1:
        raise ExportError(f"--max-context must be >= 1, got {opts.max_context}")
    if opts.device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", opts.device):
        raise ExportError(f"--device {opts.device!r}: use cpu, cuda or cuda:N")
    if opts.runtime not in ("auto", "native", "python"):
        raise ExportError(f"--runtime {opts.runtime!r}: use native or python")
    if opts.generate_runtime not in ("torch", "onnx"):
        raise ExportError(f"--generate-runtime {opts.generate_runtime!r}: use torch or onnx")
    if opts.max_batch_size < 1:
        raise ExportError("--max-batch-size must be >= 1 (dynamic batching needs a batch dimension)")
    if opts.max_queue_delay_us < 0:
        raise ExportError("--max-queue-delay-us must be >= 0")
    if opts.instances < 1:
        raise ExportError("--instances must be >= 1")
    if opts.kv_cache_bytes is not None and opts.kv_cache_fraction is not None:
        raise ExportError("give --kv-cache-bytes or --kv-cache-fraction, not both")
    if opts.kv_cache_fraction is not None and not 0 < opts.kv_cache_fraction <= 1:
        raise ExportError("--kv-cache-fraction must be in (0, 1]")


def _check_same_tokenizer(tok, dtok, model: str, draft: str) -> None:
    """The engine's check (it would refuse this draft at load), worded for the export's options."""
    from tritonlm.engine.tokenizer import TokenizerMismatch, check_same_tokenizer

    try:
        check_same_tokenizer(tok, dtok, draft)
    except TokenizerMismatch as e:
        def where(token_id) -> str:
            return "absent" if token_id is None else f"id {token_id}"

        raise ExportError(
            f"--draft {draft} does not share the tokenizer of {model} (vocabularies of {e.target_size} and "
            f"{e.draft_size} tokens; {e.differ} of {e.total} tokens differ, e.g. {e.example!r}: "
            f"{where(e.target_id)} in {model}, {where(e.draft_id)} in the draft): "
            "pick a draft model of the same family/tokenizer"
        ) from None


def _write_forward_models(staging, repo, name, formats, model, info, spec, runtime, batching, opts, progress, out):
    from tritonlm.export.onnx_export import convert_fp16, export_decoder_onnx, quantize_int8
    from tritonlm.export.torchscript_export import export_decoder_torchscript
    from tritonlm.export.verify import Reference, onnx_decoder_fn, torchscript_decoder_fn, verify_decoder

    if not formats:
        return []
    reference = Reference(model)  # PyTorch's side, computed once for all formats
    results: list[ArtifactResult] = []
    fp32_onnx: Path | None = None  # the fp32 ONNX, whether kept or only a source for int8/fp16

    def get_fp32() -> Path:
        nonlocal fp32_onnx
        if fp32_onnx is None:
            existing = repo / forward_model_name(name, "onnx")
            kept = staging / forward_model_name(name, "onnx") / "1" / "model.onnx"
            if kept.exists():
                fp32_onnx = kept
            elif _reusable(existing, artifact_fingerprint(info.fingerprint, "onnx"), ["model.onnx"]):
                fp32_onnx = existing / "1" / "model.onnx"
            else:
                tmp = staging / ".fp32" / "model.onnx"
                with progress.step("exporting the fp32 ONNX decoder (source for int8/fp16)"):
                    export_decoder_onnx(model, tmp)
                fp32_onnx = tmp
        return fp32_onnx

    for fmt in formats:
        model_name = forward_model_name(name, fmt)
        artifact = FORMATS[fmt][1]
        fingerprint = artifact_fingerprint(info.fingerprint, fmt)
        dst_dir = staging / model_name
        version = dst_dir / "1"
        existing = repo / model_name
        if not opts.force and _reusable(existing, fingerprint, [artifact]):
            _link_tree(existing / "1", version)
            stamp = _read_stamp(version) or {}
            ver = stamp.get("verification", {})
            out(f"{fmt}: reusing the verified {existing / '1' / artifact} (same model and exporter)")
            results.append(ArtifactResult(fmt, model_name, f"{model_name}/1/{artifact}", _size(version / artifact), 0.0,
                                          True, ver.get("max_abs_logit_diff", float("nan")),
                                          ver.get("top1_agreement", float("nan"))))
        else:
            version.mkdir(parents=True, exist_ok=True)
            path = version / artifact
            t0 = time.monotonic()
            with progress.step(f"{fmt}: exporting {model_name}/1/{artifact}"):
                if fmt == "onnx":
                    export_decoder_onnx(model, path)
                    fp32_onnx = path
                elif fmt == "onnx-int8":
                    quantize_int8(get_fp32(), path)
                elif fmt == "onnx-fp16":
                    convert_fp16(get_fp32(), path)
                else:
                    export_decoder_torchscript(model, path)
            with progress.step(f"{fmt}: verifying against PyTorch (prefill, decode, left- and mid-padded batches)"):
                fn = torchscript_decoder_fn(path) if fmt == "torchscript" else onnx_decoder_fn(path)
                report = verify_decoder(fn, model, fmt, seed=opts.verify_seed, reference=reference)
            out(f"  {report.summary()}")
            failure = report.failure()
            if failure:
                for c in report.cases:
                    out(f"  case {c.name}: max |logit diff| {c.max_abs_diff:.3g}, top-1 {c.top1_agree}/{c.positions}, "
                        f"non-finite {c.nonfinite}")
                hint = ""
                if fmt == "onnx-int8":
                    hint = (" (dynamic int8 quantization is too lossy for this model: leave onnx-int8 out of "
                            "--formats and use onnx or onnx-fp16)")
                raise ExportError(
                    f"{fmt} artifact failed verification against PyTorch ({failure}){hint}; "
                    f"nothing was written to {repo}"
                )
            report.save(version / (Path(artifact).stem + VERIFY_SUFFIX))
            stamp = {
                "fingerprint": fingerprint,
                "format": fmt,
                "artifact": artifact,
                "passed": True,
                "source": info.to_json(),
                "code_version": code_version(),
                "verification": report.to_json(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (version / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            results.append(ArtifactResult(fmt, model_name, f"{model_name}/1/{artifact}", _size(path),
                                          time.monotonic() - t0, False, report.max_abs_diff, report.top1_agreement))
        write_config(dst_dir, forward_config(model_name, fmt, spec, runtime, batching, artifact))
    shutil.rmtree(staging / ".fp32", ignore_errors=True)
    return results


def _write_hf(staging, repo, name, model, tok, info, progress, out) -> None:
    """NAME/1/hf: weights (safetensors, float32), config and tokenizer, for the engine."""
    fingerprint = artifact_fingerprint(info.fingerprint, "hf")
    existing = repo / name
    version = staging / name / "1"
    if _reusable(existing, fingerprint, ["hf/config.json"]):
        _link_tree(existing / "1", version)
        out(f"{name}: reusing {existing / '1' / 'hf'} (same model)")
        return
    with progress.step(f"{name}: saving weights, config and tokenizer to {name}/1/hf"):
        hf = version / "hf"
        hf.mkdir(parents=True, exist_ok=True)
        from transformers.utils import logging as hf_logging

        from tritonlm.export.wrapper import as_float32

        hf_logging.disable_progress_bar()
        as_float32(model).save_pretrained(hf, safe_serialization=True)
        tok.save_pretrained(hf)
        stamp = {"fingerprint": fingerprint, "format": "hf", "passed": True, "source": info.to_json(),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (version / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def _commit(staging: Path, repo: Path, models: list[str]) -> None:
    """Move each staged model folder into the repository (replacing an older one)."""
    repo.mkdir(parents=True, exist_ok=True)
    for m in models:  # all or nothing: check every target first
        dst = repo / m
        if dst.exists() and not dst.is_dir():
            raise ExportError(f"{dst} exists and is not a model folder: remove it or choose another --name")
    for m in models:
        src, dst = staging / m, repo / m
        if dst.exists():
            trash = staging / f".old-{m}"
            os.replace(dst, trash)
        os.replace(src, dst)


def export_summary_json(result: ExportResult) -> dict:
    return {"repo": str(result.repo), "name": result.name, "runtime": result.runtime,
            "models": result.models, "artifacts": [asdict(a) for a in result.artifacts]}
