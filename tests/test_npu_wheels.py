"""glmlight's Ascend path against the released torch-npu 2.14.0 wheel, read from its own sources.

Nothing of the package is imported or run: tests/wheel_names.py downloads the wheel once (pinned by
SHA-256, cached under ~/.cache/glmlight/wheels or $GLMLIGHT_WHEEL_CACHE), unpacks the Python sources
and looks names up with `ast`. The names checked are found the same way in glmlight's own sources, so
a new use is checked without editing this file:

- every ``torch_npu`` / ``torch.npu`` name glmlight uses exists in torch_npu (``torch.npu`` is
  ``torch_npu.npu``: torch_npu registers it with ``torch._register_device_module``), and every call
  of one binds to its parameters; the ``torch_npu._C`` functions those Python functions call are
  compiled into the wheel's native libraries;
- every name the stand-in in tests/npu_standin defines exists at the same module path in torch_npu,
  a function with the same parameters, and the stand-in registers ``hccl`` as torch_npu does;
- the torch names torch_npu replaces on import that glmlight calls take glmlight's arguments.

Without the package index and with nothing cached, the tests that need the wheel skip and say so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.wheel_names import (TORCH_NPU, Found, Missing, Report, Sources, Unavailable, Unknown, Use, binding_problem,
                               cache_dir, calls_named, collect_uses, literal, native_strings, public_definitions,
                               signature_difference, source_root, torch_npu_operators)

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "npu_standin" / "torch_npu"
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
UNDECIDABLE: dict[str, str] = {}


def _glmlight_files() -> list[Path]:
    return [p for p in sorted((REPO / "glmlight").rglob("*.py"))
            if any(word in p.read_text(encoding="utf-8") for word in _MENTIONS)]


@pytest.fixture(scope="module")
def sources() -> Sources:
    try:
        found = Sources({TORCH_NPU.package: source_root(TORCH_NPU)})
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
