"""glmlight's Ascend path against the released packages it runs with, read from their own sources:
torch-npu 2.14.0 (the wheel), vllm-ascend 0.23.0.post1 (its source distribution: the release has no
wheel) and vLLM 0.23.0, the vLLM that vllm-ascend release is built for.

Nothing of those packages is imported or run: tests/support/wheel_names.py downloads each file once (pinned by
SHA-256, cached under ~/.cache/glmlight/wheels or $GLMLIGHT_WHEEL_CACHE), unpacks the Python sources
and looks names up with `ast`. The names checked are found the same way in glmlight's own sources, so
a new use is checked without editing this file:

- every ``torch_npu`` / ``torch.npu`` name glmlight uses exists in torch_npu (``torch.npu`` is
  ``torch_npu.npu``: torch_npu registers it with ``torch._register_device_module``), and every call
  of one binds to its parameters; the ``torch_npu._C`` functions those Python functions call are
  compiled into the wheel's native libraries;
- every name the stand-in in tests/support/npu_standin defines exists at the same module path in torch_npu,
  a function with the same parameters, and the stand-in registers ``hccl`` as torch_npu does;
- the torch names torch_npu replaces on import that glmlight calls take glmlight's arguments;
- every ``vllm_ascend`` and ``vllm`` name glmlight's worker extension and in-process engine use
  exists in vllm-ascend 0.23.0.post1 / vLLM 0.23.0, calls bind, and the extension fits vLLM-Ascend's
  worker classes (vLLM mixes it into them: no name clash; the attributes it reads exist; the models'
  ``load_weights`` take its keyword);
- ASCEND_OPTIONS names only settings those releases read.

Without the package index and with nothing cached, the tests that need the releases skip and say so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from glmlight.engines.servers.vllm.wire import ASCEND_OPTIONS
from tests.support.wheel_names import (RELEASES, TORCH_NPU, VLLM, VLLM_ASCEND, Found, Missing, Report, Sources,
                                       Unavailable, Unknown, Use, binding_problem, cache_dir, call_shape, calls_named,
                                       collect_uses, dict_keys, literal, native_strings, public_definitions, self_uses,
                                       signature_difference, source_root, string_assignments, torch_npu_operators)

REPO = Path(__file__).resolve().parents[3]
STANDIN = REPO / "tests" / "support" / "npu_standin" / "torch_npu"
EXTENSION_FILE = REPO / "glmlight" / "engines" / "servers" / "worker" / "vllm_extension.py"
_MENTIONS = ("npu", "vllm", "ShardedGradScaler", "_new_process_group_helper")

# torch names glmlight calls on the NPU path that torch_npu replaces when it is imported (read in
# torch_npu's sources; the test checks that the replacement is there and takes glmlight's arguments).
TORCH_REPLACED = {
    # torch_npu/_init/patches/distributed_patches.py: _apply_sharded_grad_scaler_patch
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler":
        ("torch_npu._init.patches.distributed_patches", "torch_npu.npu.amp.sharded_grad_scaler._ShardedGradScaler"),
    # torch_npu/_compat/distributed.py, applied on torch < 2.14
    "torch.distributed.distributed_c10d._new_process_group_helper":
        ("torch_npu._compat.distributed", "torch_npu._compat.distributed._new_process_group_helper"),
}

# Uses the sources cannot decide, each with what was checked instead.
UNDECIDABLE = {
    "vllm.model_executor.model_loader.reload.layerwise.LAYERWISE_INFO.get":
        "a WeakKeyDictionary (annotated so in vllm/model_executor/model_loader/reload/layerwise.py)",
    "vllm.model_executor.model_loader.reload.layerwise.LAYERWISE_INFO.get().reset":
        "its values are LayerReloadingInfo (the annotation), which defines reset "
        "(test_vllm_names_the_worker_extension_uses_exist)",
    "vllm.model_executor.model_loader.reload.layerwise.LOADING_LAYERS.clear": "a WeakSet (the annotation)",
}


def _glmlight_files() -> list[Path]:
    return [p for p in sorted((REPO / "glmlight").rglob("*.py"))
            if any(word in p.read_text(encoding="utf-8") for word in _MENTIONS)]


@pytest.fixture(scope="module")
def sources() -> Sources:
    try:
        found = Sources({r.package: source_root(r) for r in RELEASES})
    except Unavailable as err:
        pytest.skip(f"{err}; with the package index reachable once, the files are kept in {cache_dir()} "
                    "(GLMLIGHT_WHEEL_CACHE)")
    operators = torch_npu_operators(found)
    assert len(operators) > 100 and operators["npu_fusion_attention"].kind == "function"
    found.declare("torch_npu", operators)
    return found


@pytest.fixture(scope="module")
def uses():
    return collect_uses(REPO, _glmlight_files())


def _npu_qual(qual: str) -> str | None:
    """torch_npu's name for a glmlight use: ``torch.npu.x`` is ``torch_npu.npu.x``."""
    if qual == "torch.npu" or qual.startswith("torch.npu."):
        return "torch_npu.npu" + qual[len("torch.npu"):]
    return qual if qual.split(".")[0] == "torch_npu" else None


def _check_uses(sources: Sources, picked: list[tuple[Use, str]], label: str, report: Report,
                undecided: dict[str, str]) -> None:
    """Each use looked up under its name in the release (`real`); a call's shape bound to the parameters."""
    for use, real in picked:
        got = sources.resolve(real)
        if isinstance(got, Missing):
            if not use.optional:
                report.add(f"{use.where}: {use.qual}: {got.reason} in {label}")
        elif isinstance(got, Unknown):
            undecided[use.qual] = f"{use.where}: {got.reason}"
        elif use.shape is not None:
            problem = binding_problem(got, use.shape, sources)
            if problem:
                report.add(f"{use.where}: {use.qual}{use.shape}: {problem} in {label}")


def _assert_clean(report: Report, undecided: dict[str, str], what: str) -> None:
    unexpected = {q: why for q, why in undecided.items() if q not in UNDECIDABLE}
    lines = [*report.lines, *(f"{why}: {q} cannot be decided from the sources; check it another way and list it "
                              "in UNDECIDABLE" for q, why in unexpected.items())]
    assert not lines, f"{what}:\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------------------ torch_npu


def test_torch_npu_names_glmlight_uses_exist(sources, uses):
    picked = [(u, _npu_qual(u.qual)) for u in uses if _npu_qual(u.qual)]
    assert {"torch.npu.set_device", "torch.npu.device_count", "torch.npu.memory_stats", "torch.npu.empty_cache",
            "torch.npu.is_available", "torch.npu.current_device"} <= {u.qual for u, _ in picked}, \
        "the scan of glmlight's sources no longer sees the plugin's torch.npu calls"
    report, undecided = Report(), {}
    _check_uses(sources, picked, TORCH_NPU.label, report, undecided)
    _assert_clean(report, undecided, f"glmlight uses torch_npu names that {TORCH_NPU.label} does not have")


def test_torch_npu_registers_torch_npu_and_hccl_as_the_standin_does(sources):
    """``torch.npu`` is torch_npu.npu, the device type is "npu", and ``hccl`` is registered through
    ``Backend.register_backend`` with the same calling convention the stand-in uses."""
    real = [sources.module(m) for m in ("torch_npu._init.registry.backend", "torch_npu._init.registry.distributed")]
    assert all(real), f"{TORCH_NPU.label} moved its device/backend registration; find it again"
    device_module = [c for t in real for c in calls_named(t, "_register_device_module")]
    assert [(literal(c.args[0]), ast.unparse(c.args[1])) for c in device_module] == [("npu", "torch_npu.npu")]
    renames = [c for t in real for c in calls_named(t, "rename_privateuse1_backend")]
    assert [literal(c.args[0]) for c in renames] == ["npu"]

    def hccl(tree: ast.AST) -> list[tuple[object, int]]:
        out = []
        for call in calls_named(tree, "Backend.register_backend"):
            if literal(call.args[0]) == "hccl":
                creator = call.args[1]
                arity = len(creator.args.args) if isinstance(creator, ast.Lambda) else None
                if isinstance(creator, ast.Name):
                    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == creator.id)
                    arity = len(fn.args.args)
                out.append((next((literal(k.value) for k in call.keywords if k.arg == "extended_api"), False), arity))
        return out

    standin = ast.parse((STANDIN / "__init__.py").read_text(encoding="utf-8"))
    assert hccl(real[1]) == [(True, 2)]  # creator(dist_backend_opts, pg_options)
    assert hccl(standin) == hccl(real[1]), "the stand-in registers hccl differently from torch_npu"


def test_standin_defines_only_torch_npu_names_with_the_same_signatures(sources):
    defs, hooks = public_definitions(STANDIN, REPO)
    assert {d.qual for d in defs} >= {"torch_npu.npu.set_device", "torch_npu.npu.memory.memory_stats"}
    report = Report()
    for d in defs:
        got = sources.resolve(d.qual)
        if not isinstance(got, Found):
            report.add(f"{d.where}: {d.qual}: {got.reason} in {TORCH_NPU.label}")
        elif isinstance(d.node, ast.FunctionDef):
            if got.kind != "function" or not isinstance(got.node, ast.FunctionDef):
                report.add(f"{d.where}: {d.qual} is a function in the stand-in, a {got.kind} in {TORCH_NPU.label}")
            else:
                diff = signature_difference(d.node, got.node, bound=False)
                if diff:
                    report.add(f"{d.where}: {d.qual}: {diff} ({got.qual})")
        elif isinstance(d.node, ast.ClassDef) and got.kind != "class":
            report.add(f"{d.where}: {d.qual} is a class in the stand-in, a {got.kind} in {TORCH_NPU.label}")
    for module, names in hooks.items():
        for name in sorted(names):
            if isinstance(sources.resolve(f"{module}.{name}"), Found):
                report.add(f"stand-in hook {module}.{name} is also a {TORCH_NPU.label} name: mirror the real one")
    assert not report, f"the torch_npu stand-in differs from {TORCH_NPU.label}:\n{report}"


def test_torch_npu_native_functions_behind_the_used_names_are_compiled_in(sources, uses):
    """The Python functions glmlight and the stand-in reach call ``torch_npu._C._…`` functions; those
    names must be in the wheel's native libraries (found as strings: nothing is loaded)."""
    targets: list[Found] = []
    for qual in {_npu_qual(u.qual) for u in uses} | {d.qual for d in public_definitions(STANDIN, REPO)[0]}:
        got = sources.resolve(qual) if qual else None
        if isinstance(got, Found) and got.kind == "function":
            targets.append(got)
    compiled = native_strings(TORCH_NPU)
    needed: dict[str, str] = {}
    seen: set[str] = set()
    while targets:  # the functions' own calls of functions in their module, followed
        fn = targets.pop()
        if fn.qual in seen or not isinstance(fn.node, ast.FunctionDef):
            continue
        seen.add(fn.qual)
        for node in ast.walk(fn.node):
            text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
            if text.startswith("torch_npu._C.") and text.count(".") == 2:
                needed.setdefault(text.split(".")[2], fn.qual)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                callee = sources.module_member(fn.module, node.func.id)
                if isinstance(callee, Found) and callee.kind == "function":
                    targets.append(callee)
    assert "_npu_setDevice" in needed and len(needed) >= 5, sorted(needed)
    missing = [f"{name} (called by {caller})" for name, caller in sorted(needed.items()) if name not in compiled]
    assert not missing, f"torch_npu._C functions not in {TORCH_NPU.label}'s native libraries: {missing}"


def test_torch_names_torch_npu_replaces_take_glmlight_arguments(sources, uses):
    report, checked = Report(), 0
    for torch_name, (patch_module, replacement) in TORCH_REPLACED.items():
        tree = sources.module(patch_module)
        leaf = torch_name.rsplit(".", 1)[1]
        assert tree is not None and any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == leaf for t in n.targets)
            for n in ast.walk(tree)), f"{patch_module} no longer replaces {torch_name}"
        got = sources.resolve(replacement)
        assert isinstance(got, Found), f"{replacement}: {got.reason}"
        for use in (u for u in uses if u.qual == torch_name and u.shape is not None):
            checked += 1
            problem = binding_problem(got, use.shape, sources)
            if problem:
                report.add(f"{use.where}: {torch_name}{use.shape}: after import torch_npu it is {replacement}: "
                           f"{problem}")
    assert checked >= 2 and not report, str(report)


# ------------------------------------------------------------------------------------------------ vLLM-Ascend


def _in_vllm_qual(use) -> bool:
    return use.qual.split(".")[0] in ("vllm_ascend", "vllm")


def test_vllm_names_the_worker_extension_uses_exist(sources, uses):
    picked = [(u, u.qual) for u in uses if _in_vllm_qual(u)]
    assert {"vllm.model_executor.model_loader.reload.initialize_layerwise_reload",
            "vllm.model_executor.model_loader.reload.finalize_layerwise_reload",
            "vllm_ascend.ascend_config.get_ascend_config().weight_nz_mode"} <= {u.qual for u, _ in picked}
    report, undecided = Report(), {}
    labels = {"vllm_ascend": VLLM_ASCEND.label, "vllm": VLLM.label}
    for use, real in picked:
        _check_uses(sources, [(use, real)], labels[real.split(".")[0]], report, undecided)
    info = sources.resolve("vllm.model_executor.model_loader.reload.types.LayerReloadingInfo.reset")
    if not isinstance(info, Found) or info.kind != "function":
        report.add(f"LayerReloadingInfo.reset (what glmlight_revert calls on LAYERWISE_INFO's values): "
                   f"{getattr(info, 'reason', info.kind)}")
    _assert_clean(report, undecided, "the worker extension uses names vLLM-Ascend 0.23.0.post1 / vLLM 0.23.0 lack")
    stale = set(UNDECIDABLE) - {u.qual for u in uses}
    assert not stale, f"UNDECIDABLE lists names glmlight no longer uses: {sorted(stale)}"


def _worker_classes(sources: Sources) -> list[Found]:
    """The worker classes vLLM-Ascend's platform chooses (``parallel_config.worker_cls = "…"``)."""
    platform = sources.module("vllm_ascend.platform")
    names = string_assignments(platform, "worker_cls")
    assert "vllm_ascend.worker.worker.NPUWorker" in names, names
    out = []
    for name in names:
        got = sources.resolve(name)
        assert isinstance(got, Found) and got.kind == "class", f"{name}: {getattr(got, 'reason', got)}"
        out.append(got)
    return out


def test_worker_extension_fits_vllm_ascend_workers(sources):
    """vLLM (vllm/v1/worker/worker_base.py) adds ``--worker-extension-cls`` to the worker class's
    bases after asserting that the worker has none of the extension's attributes; the extension then
    reads the worker's own attributes (``self.model_runner.get_model()``, ``self.vllm_config``, ...)."""
    tree = ast.parse(EXTENSION_FILE.read_text(encoding="utf-8"))
    ext = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WeightLoaderExtension")
    own = {n.name for n in ext.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own |= {t.id for n in ext.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    chains = [c for c in self_uses(ext) if c[0] and c[0][0].removesuffix("()") not in own
              and not c[0][0].startswith("__")]
    assert {c[0][:2] for c in chains} >= {("model_runner", "get_model"), ("vllm_config", "model_config")}
    report = Report()
    for worker in _worker_classes(sources):
        for name in sorted(own):
            clash = sources.class_member(worker, name, instance=False)
            if not isinstance(clash, Missing):
                report.add(f"{worker.qual} already has {name} ({getattr(clash, 'qual', clash)}): vLLM refuses the "
                           "extension")
        for chain, shape, optional, line in chains:
            current = Found("value", f"{worker.qual}()", worker.module, worker.node, types=(worker.qual,))
            for i, part in enumerate(chain):
                called = part.endswith("()")
                got = sources.member(current, part[:-2] if called else part)
                if isinstance(got, Found) and called:
                    got = sources.result_of(got)
                if not isinstance(got, Found):
                    if not (optional and i == len(chain) - 1 and isinstance(got, Missing)):  # getattr(.., default)
                        undecidable = " cannot be decided from the sources" if isinstance(got, Unknown) else ""
                        report.add(f"{EXTENSION_FILE.relative_to(REPO)}:{line}: self.{'.'.join(chain)}{undecidable}: "
                                   f"{got.reason} ({worker.qual}, {VLLM_ASCEND.label} / {VLLM.label})")
                    break
                current = got
            else:
                if shape is not None:
                    problem = binding_problem(current, shape, sources)
                    if problem:
                        report.add(f"{EXTENSION_FILE.relative_to(REPO)}:{line}: self.{'.'.join(chain)}{shape}: "
                                   f"{problem} ({worker.qual})")
    assert not report, f"the worker extension does not fit {VLLM_ASCEND.label}'s workers:\n{report}"


def test_vllm_ascend_models_load_weights_take_the_extension_keywords(sources):
    shapes = {call_shape(c) for c in calls_named(ast.parse(EXTENSION_FILE.read_text(encoding="utf-8")), "load_weights")}
    assert shapes, "the worker extension no longer calls load_weights"
    report, checked = Report(), 0
    root = source_root(VLLM_ASCEND)
    for path in sorted((root / "vllm_ascend").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        if "model_loader" in rel.parts or "def load_weights" not in path.read_text(encoding="utf-8-sig"):
            continue  # model loaders' load_weights(model, model_config) is another API
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for cls in (n for n in ast.walk(sources.module(module)) if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights"):
                checked += 1
                found = Found("function", f"{module}.{cls.name}.load_weights", module, fn)
                for shape in shapes:
                    problem = binding_problem(found, shape, sources)
                    if problem:
                        report.add(f"{found.qual}: the extension calls load_weights{shape}: {problem}")
    assert checked >= 2 and not report, str(report)


def test_ascend_options_are_settings_vllm_ascend_reads(sources):
    report = Report()
    platform = sources.resolve("vllm_ascend.platform.NPUPlatform.device_type")
    device = literal(platform.node.value) if isinstance(platform, Found) else None  # type: ignore[attr-defined]
    if device != ASCEND_OPTIONS["device"]:
        report.add(f"ASCEND_OPTIONS['device'] is {ASCEND_OPTIONS['device']!r}; vLLM-Ascend's NPUPlatform.device_type "
                   f"is {device!r}")
    known_env = dict_keys(sources.module("vllm.envs"), "environment_variables")
    known_env |= dict_keys(sources.module("vllm_ascend.envs"), "env_variables")
    assert len(known_env) > 100
    for name in ASCEND_OPTIONS["env"]:
        if name not in known_env:
            report.add(f"ASCEND_OPTIONS['env'] sets {name}, which neither {VLLM.label} nor {VLLM_ASCEND.label} "
                       "reads (vLLM warns about unknown VLLM_ variables)")
    config = sources.module("vllm_ascend.ascend_config")
    keys = {literal(c.args[1]) for c in calls_named(config, "_get_config_value") if len(c.args) > 1}
    keys |= {literal(c.args[0]) for c in calls_named(config, "additional_config.get") if c.args}
    for key in ASCEND_OPTIONS.get("additional_config", {}):
        if key not in keys:
            report.add(f"ASCEND_OPTIONS['additional_config'] sets {key!r}, which {VLLM_ASCEND.label}'s AscendConfig "
                       "does not read")
    engine_args = sources.resolve("vllm.engine.arg_utils.EngineArgs")
    for key in [*ASCEND_OPTIONS.get("llm_kwargs", {}), "additional_config"]:  # the in-process engine's vllm.LLM kwargs
        if not isinstance(engine_args, Found) or not isinstance(sources.class_member(engine_args, key), Found):
            report.add(f"ASCEND_OPTIONS['llm_kwargs'] passes {key!r}, which is not an EngineArgs field in {VLLM.label}")
    assert not report, str(report)


# ------------------------------------------------------------------------------------------------ the scan


def test_scan_follows_aliases_returns_and_getattr(tmp_path):
    """The collector itself, on a module written like glmlight's plugin (no download needed)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        "import torch\n"
        "from vllm_ascend.ascend_config import get_ascend_config as gac\n"
        "def _load():\n"
        "    import torch_npu\n"
        "    return torch.npu\n"
        "def need():\n"
        "    npu = _load()\n"
        "    return npu\n"
        "def use(device):\n"
        "    need().set_device(device)\n"
        "    n = getattr(torch, 'npu', None)\n"
        "    n.memory_stats(device=device)\n"
        "    return gac().weight_nz_mode, getattr(need(), 'maybe', None)\n")
    (pkg / "other.py").write_text("from pkg.mod import need\nneed().empty_cache()\n")
    got = {(u.qual, str(u.shape) if u.shape else None, u.optional) for u in collect_uses(tmp_path, pkg.rglob("*.py"))}
    assert ("torch.npu.set_device", "(_)", False) in got
    assert ("torch.npu.memory_stats", "(device=_)", False) in got
    assert ("torch.npu.empty_cache", "()", False) in got
    assert ("vllm_ascend.ascend_config.get_ascend_config().weight_nz_mode", None, False) in got
    assert ("torch.npu.maybe", None, True) in got
    assert ("torch_npu", None, False) in got
