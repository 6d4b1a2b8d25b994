"""Static reading of released packages: the torch_npu, vLLM-Ascend and vLLM releases glmlight's Ascend
path is checked against (tests/unit/accelerators/test_npu_wheels.py).

Nothing here imports those packages or loads their native libraries. Each release is downloaded once
from the package index (its file pinned by name and SHA-256), its Python sources are unpacked into a
cache directory, and names are looked up by parsing those sources with `ast`:

- `Sources.resolve("torch_npu.npu.memory_stats")` follows modules, ``def``/``class``, assignments,
  annotated names, ``from … import`` re-exports, ``import *`` (through ``__all__``) and names a
  module declares in ``__all__`` but binds lazily (vLLM's ``vllm.LLM``); on classes, methods, class
  attributes and ``self.<name> = …`` attributes, through base classes; ``f()`` is what ``f`` returns
  (its return annotation, or the class it constructs or keeps in a module global).
- `collect_uses` walks glmlight's sources for the names it takes from those packages (attribute
  chains on ``torch_npu``, ``torch.npu``, ``vllm_ascend``, ``vllm`` and ``torch``, including through
  local variables and through glmlight functions that return them, such as ``require_npu()``), with
  the shape of each call (positional count, keyword names).
- `public_definitions` lists what a stand-in package defines, to compare with the real one.

A wheel's native code is not read as code: `native_strings` is the set of NUL-terminated identifiers
in its extension libraries, enough to see that a ``torch_npu._C`` function its Python wrappers call is
compiled in.
"""

from __future__ import annotations

import ast
import hashlib
import html
import json
import os
import re
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------------------- releases


@dataclass(frozen=True)
class Release:
    project: str
    version: str
    filename: str
    sha256: str
    package: str  # the top-level package read from it
    native: tuple[str, ...] = ()  # extension libraries (paths inside a wheel) whose identifiers are kept

    @property
    def label(self) -> str:
        return f"{self.project} {self.version}"


TORCH_NPU = Release(
    "torch-npu", "2.14.0", "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    "7736f7d82cf9f16c7dfc4537f7e7c638153da760273a193455e70857f912189e", "torch_npu",
    native=("torch_npu/_C.cpython-311-x86_64-linux-gnu.so", "torch_npu/lib/libtorch_npu.so"))
# Published as a source distribution only; its Python package is read as is (nothing is built).
VLLM_ASCEND = Release(
    "vllm-ascend", "0.23.0.post1", "vllm_ascend-0.23.0.post1.tar.gz",
    "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1", "vllm_ascend")
# The vLLM release vllm-ascend 0.23.0.post1 is built for (its README: the releases/v0.23.0 branch
# follows vLLM v0.23.0): base classes and the vLLM names the worker extension uses inside its workers.
VLLM = Release(
    "vllm", "0.23.0", "vllm-0.23.0.tar.gz",
    "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5", "vllm")
RELEASES = (TORCH_NPU, VLLM_ASCEND, VLLM)


class Unavailable(Exception):
    """The index could not be reached (and nothing is cached): the caller skips."""


def cache_dir() -> Path:
    return Path(os.environ.get("GLMLIGHT_WHEEL_CACHE") or Path.home() / ".cache" / "glmlight" / "wheels")


def index_url() -> str:
    return (os.environ.get("GLMLIGHT_WHEEL_INDEX") or os.environ.get("PIP_INDEX_URL")
            or "https://pypi.org/simple").rstrip("/")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_url(release: Release, timeout_s: float) -> str:
    """The download URL of the release's file, from the index's simple API (JSON or HTML)."""
    page = f"{index_url()}/{re.sub(r'[-_.]+', '-', release.project).lower()}/"
    request = urllib.request.Request(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        kind, body = response.headers.get("Content-Type", ""), response.read()
    if "json" in kind:
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == release.filename:
                return urllib.parse.urljoin(page, entry["url"])
    else:
        for href, text in re.findall(rb'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body):
            if html.unescape(text.decode()).strip() == release.filename:
                return urllib.parse.urljoin(page, html.unescape(href.decode()))
    raise Unavailable(f"{page} does not list {release.filename}")


def download(release: Release, timeout_s: float = 60.0) -> Path:
    """The release's file in the cache, downloaded if missing; its SHA-256 is always checked."""
    target = cache_dir() / release.filename
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            url = _file_url(release, timeout_s)
            partial = target.with_name(target.name + ".part")
            with urllib.request.urlopen(url, timeout=timeout_s) as response, open(partial, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
        except (urllib.error.URLError, OSError) as err:  # unreachable index, DNS, timeout, HTTP error
            raise Unavailable(f"{release.label} could not be downloaded from {index_url()}: {err}") from err
        partial.replace(target)
    got = _sha256(target)
    if got != release.sha256:
        target.unlink()
        raise RuntimeError(f"{release.filename}: SHA-256 {got}, expected {release.sha256} (the cached copy "
                           "was removed)")
    return target


def _native_identifiers(data: bytes) -> set[str]:
    return {m.decode() for m in re.findall(rb"(?<=\x00)[A-Za-z_][A-Za-z0-9_.]{1,120}(?=\x00)", data)}


def source_root(release: Release) -> Path:
    """A directory holding the release's top-level package (``.py``/``.pyi`` files only), unpacked
    once into the cache; for a wheel with native libraries also ``native_strings.txt``."""
    root = cache_dir() / f"{release.filename}.src"
    marker = root / ".complete"
    if marker.is_file() and marker.read_text() == release.sha256:
        return root
    archive = download(release)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    prefix = release.package + "/"

    def keep(rel: str) -> bool:
        return rel.startswith(prefix) and rel.endswith((".py", ".pyi")) and ".." not in rel.split("/")

    if release.filename.endswith(".whl"):
        with zipfile.ZipFile(archive) as whl:
            for name in whl.namelist():
                if keep(name):
                    (root / name).parent.mkdir(parents=True, exist_ok=True)
                    (root / name).write_bytes(whl.read(name))
            strings: set[str] = set()
            for name in release.native:
                strings |= _native_identifiers(whl.read(name))
            if release.native:
                (root / "native_strings.txt").write_text("\n".join(sorted(strings)))
    else:
        with tarfile.open(archive, "r:gz") as sdist:
            for member in sdist:
                rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                if member.isfile() and keep(rel):
                    (root / rel).parent.mkdir(parents=True, exist_ok=True)
                    (root / rel).write_bytes(sdist.extractfile(member).read())  # type: ignore[union-attr]
    marker.write_text(release.sha256)
    return root


def native_strings(release: Release) -> set[str]:
    path = source_root(release) / "native_strings.txt"
    return set(path.read_text().split("\n")) if path.is_file() else set()


# ---------------------------------------------------------------------------------------------- lookups


@dataclass
class Found:
    """Where a name is defined: a module, a function, a class or a value (``kind``)."""

    kind: str
    qual: str  # where it lives, e.g. torch_npu.npu.memory.memory_stats
    module: str  # the module whose source holds `node`
    node: ast.AST | None = None
    types: tuple[str, ...] = ()  # for a value: the classes it may hold, when known
    how: str = ""


@dataclass
class Missing:
    reason: str


@dataclass
class Unknown:
    """The sources cannot decide (a value of an unknown type, a base class outside the sources)."""

    reason: str


Lookup = Found | Missing | Unknown


def _dotted(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return f"{base}.{expr.attr}" if base else None
    return None


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module or class statements, looking into if/try/with blocks but not into functions."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *[h.body for h in stmt.handlers]):
                yield from _top_level(block)
        elif isinstance(stmt, ast.With):
            yield from _top_level(stmt.body)


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    out = []
    for t in targets:
        for node in ast.walk(t):
            if isinstance(node, ast.Name):
                out.append(node.id)
    return out


def _literal(node: ast.AST | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return _Unevaluated


class _Unevaluated:  # a default that is not a literal
    pass


class Sources:
    """Python sources of several top-level packages (one directory each), parsed on demand."""

    def __init__(self, roots: dict[str, Path]):
        self.roots = roots
        self._parsed: dict[str, ast.Module | None] = {}
        self._resolved: dict[str, Lookup] = {}
        self._declared: dict[str, dict[str, Found]] = {}

    def declare(self, module: str, names: dict[str, Found]) -> None:
        """Names a module gets at run time that its source does not bind (found another way)."""
        self._declared.setdefault(module, {}).update(names)
        self._resolved.clear()

    # -------------------------------------------------------------------------------- modules
    def module_file(self, dotted: str) -> Path | None:
        parts = dotted.split(".")
        base = self.roots.get(parts[0])
        if base is None:
            return None
        path = base.joinpath(*parts)
        for candidate in (path / "__init__.py", path.with_suffix(".py"), path / "__init__.pyi",
                          path.with_suffix(".pyi")):
            if candidate.is_file():
                return candidate
        return None

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._parsed:
            path = self.module_file(dotted)
            self._parsed[dotted] = ast.parse(path.read_text(encoding="utf-8-sig"), str(path)) if path else None
        return self._parsed[dotted]

    def is_package(self, dotted: str) -> bool:
        path = self.module_file(dotted)
        return path is not None and path.stem == "__init__"

    def relative(self, module: str, level: int, name: str | None) -> str:
        """The absolute module named by ``from <level dots><name> import …`` inside `module`."""
        if level == 0:
            return name or ""
        parts = module.split(".")
        package = parts if self.is_package(module) else parts[:-1]
        base = package[: len(package) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    def owns(self, qual: str) -> bool:
        return qual.split(".")[0] in self.roots

    # -------------------------------------------------------------------------------- resolution
    def resolve(self, qual: str) -> Lookup:
        """Find ``qual`` (dots; a part ending in ``()`` is that callable's result)."""
        if qual not in self._resolved:
            self._resolved[qual] = Unknown(f"{qual} refers to itself")  # a cycle, while resolving
            self._resolved[qual] = self._resolve(qual)
        return self._resolved[qual]

    def _resolve(self, qual: str) -> Lookup:
        parts = qual.split(".")
        for i in range(len(parts), 0, -1):
            name = ".".join(parts[:i])
            if "()" not in name and self.module(name) is not None:
                current: Lookup = Found("module", name, name)
                break
        else:
            return Missing(f"no module {parts[0]}")
        for part in parts[i:]:
            assert isinstance(current, Found)
            called = part.endswith("()")
            attr = part[:-2] if called else part
            current = self.member(current, attr)
            if isinstance(current, Found) and called:
                current = self.result_of(current)
            if not isinstance(current, Found):
                return current
        return current

    def member(self, owner: Found, name: str, _seen: frozenset[str] = frozenset()) -> Lookup:
        if owner.kind == "module":
            return self.module_member(owner.qual, name, _seen)
        if owner.kind == "class":
            return self.class_member(owner, name)
        if owner.kind == "value" and owner.types:
            results = [self.member(t, name) for t in self.type_founds(owner)]
            for r in results:
                if not isinstance(r, Found):
                    return r
            if results:
                return results[0]
        return Unknown(f"{owner.qual} is a {owner.kind} of a type the sources do not show")

    def module_member(self, module: str, name: str, _seen: frozenset[str] = frozenset()) -> Lookup:
        key = f"{module}.{name}"
        if key in _seen:
            return Missing(f"{key} is an import cycle")
        _seen = _seen | {key}
        tree = self.module(module)
        if tree is None:
            return Missing(f"no module {module}")
        stars: list[str] = []
        for stmt in _top_level(tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found("function", key, module, stmt, how="def")
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Found("class", key, module, stmt, how="class")
            if name in _assigned_names(stmt):
                value = getattr(stmt, "value", None)
                types = self._types_of(module, getattr(stmt, "annotation", None), value, None)
                return Found("value", key, module, stmt, types=types, how="assignment")
            if isinstance(stmt, ast.ImportFrom):
                source = self.relative(module, stmt.level, stmt.module)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        return self._imported(f"{source}.{alias.name}", key, module, _seen)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == name:
                        target = alias.name if alias.asname else alias.name.split(".")[0]
                        return self._imported(target, key, module, _seen)
        if self.module(key) is not None:
            return Found("module", key, key, how="submodule")
        for source in stars:
            if name in self.exported(source):
                return self.module_member(source, name, _seen)
        if name in self._declared.get(module, {}):
            return self._declared[module][name]
        if name in self.declared_all(module):
            return Found("value", key, module, how="__all__ (bound on first access)")
        return Missing(f"module {module} has no {name!r}")

    def _imported(self, target: str, key: str, module: str, _seen: frozenset[str]) -> Lookup:
        if not self.owns(target):
            return Found("value", target, module, how=f"imported into {module} from outside the sources")
        if self.module(target) is not None:
            return Found("module", target, target, how="import")
        head, _, tail = target.rpartition(".")
        return self.module_member(head, tail, _seen)

    def declared_all(self, module: str) -> list[str]:
        tree = self.module(module)
        for stmt in _top_level(tree.body if tree else []):
            if "__all__" in _assigned_names(stmt) and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                value = _literal(stmt.value)
                if isinstance(value, (list, tuple)):
                    return [str(v) for v in value]
        return []

    def exported(self, module: str) -> set[str]:
        """What ``from module import *`` binds."""
        declared = self.declared_all(module)
        if declared:
            return set(declared)
        tree = self.module(module)
        names: set[str] = set()
        for stmt in _top_level(tree.body if tree else []):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            names.update(_assigned_names(stmt))
        return {n for n in names if not n.startswith("_")}

    # -------------------------------------------------------------------------------- classes
    def bases(self, cls: Found) -> list[Lookup]:
        assert isinstance(cls.node, ast.ClassDef)
        out: list[Lookup] = []
        for base in cls.node.bases:
            dotted = _dotted(base)
            if dotted is None or dotted == "object":
                continue
            qual = self.qualify(cls.module, dotted)
            out.append(self.resolve(qual) if self.owns(qual) else Unknown(f"base class {qual} is outside the sources"))
        return out

    def class_member(self, cls: Found, name: str, instance: bool = True, _depth: int = 0) -> Lookup:
        """A method, class attribute or (with `instance`) ``self.<name>`` attribute of `cls` or a base."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        for stmt in _top_level(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                kind = "class" if isinstance(stmt, ast.ClassDef) else "function"
                return Found(kind, f"{cls.qual}.{name}", cls.module, stmt, how="class body")
            if name in _assigned_names(stmt):
                types = self._types_of(cls.module, getattr(stmt, "annotation", None), getattr(stmt, "value", None),
                                       None)
                return Found("value", f"{cls.qual}.{name}", cls.module, stmt, types=types, how="class attribute")
        if instance:
            types: list[str] = []
            found_node: ast.AST | None = None
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for stmt in ast.walk(method):
                    targets = (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                               if isinstance(stmt, ast.AnnAssign) else [])
                    for t in targets:
                        if (isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            found_node = found_node or stmt
                            types += self._types_of(cls.module, getattr(stmt, "annotation", None), stmt.value, method)
            if found_node is not None:
                return Found("value", f"{cls.qual}.{name}", cls.module, found_node, types=tuple(dict.fromkeys(types)),
                             how="instance attribute")
        unknown: Unknown | None = None
        for base in self.bases(cls):
            if isinstance(base, Found) and base.kind == "class" and _depth < 20:
                got = self.class_member(base, name, instance, _depth + 1)
                if isinstance(got, Found):
                    return got
                if isinstance(got, Unknown):
                    unknown = got
            elif not isinstance(base, Found):
                unknown = Unknown(base.reason)
        return unknown or Missing(f"class {cls.qual} has no {name!r}")

    # -------------------------------------------------------------------------------- types
    def qualify(self, module: str, dotted: str) -> str:
        """The full name of ``dotted`` as written in `module` (its imports followed)."""
        head, _, rest = dotted.partition(".")
        tree = self.module(module)
        for stmt in _top_level(tree.body if tree else []):
            if isinstance(stmt, ast.ImportFrom):
                source = self.relative(module, stmt.level, stmt.module)
                for alias in stmt.names:
                    if (alias.asname or alias.name) == head:
                        return ".".join(filter(None, [f"{source}.{alias.name}", rest]))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == head:
                        return ".".join(filter(None, [alias.name, rest]))
                    if not alias.asname and alias.name.split(".")[0] == head:
                        return dotted
        return f"{module}.{dotted}"

    def _types_of(self, module: str, annotation: ast.AST | None, value: ast.AST | None,
                  function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> tuple[str, ...]:
        """Class names a value may hold: from its annotation, a ``Class(...)`` on the right, or a
        parameter of `function` with an annotation."""
        out: list[str] = []
        for expr in (annotation, value.func if isinstance(value, ast.Call) else None):
            if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
                try:
                    expr = ast.parse(expr.value, mode="eval").body
                except SyntaxError:
                    continue
            if isinstance(expr, ast.Subscript):  # Optional[X], X | None spelt as a subscript
                expr = expr.slice
            if isinstance(expr, ast.BinOp):  # X | None
                expr = expr.left if not (isinstance(expr.left, ast.Constant)) else expr.right
            dotted = _dotted(expr) if expr is not None else None
            if dotted:
                out.append(self.qualify(module, dotted))
        if isinstance(value, ast.Name) and function is not None:
            for arg in function.args.args + function.args.kwonlyargs:
                if arg.arg == value.id and arg.annotation is not None:
                    out += self._types_of(module, arg.annotation, None, None)
        return tuple(t for t in out if self.owns(t) and isinstance(self.resolve(t), Found)
                     and self.resolve(t).kind == "class")  # type: ignore[union-attr]

    def type_founds(self, value: Found) -> list[Found]:
        out = []
        for t in value.types:
            got = self.resolve(t)
            if isinstance(got, Found) and got.kind == "class":
                out.append(got)
        return out

    def result_of(self, callee: Found) -> Lookup:
        """What calling `callee` gives: an instance of a class; for a function its annotated return
        type, or the class it constructs or keeps in a module global."""
        if callee.kind == "class":
            return Found("value", f"{callee.qual}()", callee.module, callee.node, types=(callee.qual,))
        if callee.kind != "function" or not isinstance(callee.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Unknown(f"{callee.qual} is a {callee.kind}; its result's type is not in the sources")
        fn = callee.node
        types = list(self._types_of(callee.module, fn.returns, None, None))
        if not types:
            for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
                types += self._types_of(callee.module, None, ret.value, None)
                if isinstance(ret.value, ast.Name):
                    types += self._global_types(callee.module, ret.value.id)
        if not types:
            return Unknown(f"the type of what {callee.qual}() returns is not in the sources")
        return Found("value", f"{callee.qual}()", callee.module, fn, types=tuple(dict.fromkeys(types)))

    def _global_types(self, module: str, name: str) -> list[str]:
        """Classes assigned to module global `name` anywhere in `module` (directly, or through a
        local variable of the function that assigns it)."""
        tree = self.module(module)
        out: list[str] = []
        for fn in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            local: dict[str, ast.AST] = {}
            for stmt in ast.walk(fn):
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    local.setdefault(stmt.targets[0].id, stmt.value)
            value = local.get(name)
            if isinstance(value, ast.Name):
                value = local.get(value.id, value)
            if value is not None:
                out += self._types_of(module, None, value, None)
        return out


# ---------------------------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class CallShape:
    positional: int
    keywords: tuple[str, ...]
    star_args: bool = False
    star_kwargs: bool = False

    def __str__(self) -> str:
        parts = ["_"] * self.positional + [f"{k}=_" for k in self.keywords]
        parts += ["*args"] * self.star_args + ["**kwargs"] * self.star_kwargs
        return f"({', '.join(parts)})"


def call_shape(call: ast.Call) -> CallShape:
    return CallShape(sum(not isinstance(a, ast.Starred) for a in call.args),
                     tuple(k.arg for k in call.keywords if k.arg is not None),
                     any(isinstance(a, ast.Starred) for a in call.args),
                     any(k.arg is None for k in call.keywords))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> list[tuple[str, str, object]]:
    """(name, kind, default) for each parameter; ``bound`` drops the first (self/cls)."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[object] = [_NoDefault] * (len(positional) - len(a.defaults)) + [_literal(d) for d in a.defaults]
    out = [(p.arg, "posonly" if i < len(a.posonlyargs) else "positional", d)
           for i, (p, d) in enumerate(zip(positional, defaults))]
    if bound and out:
        out = out[1:]
    if a.vararg:
        out.append((a.vararg.arg, "*", _NoDefault))
    out += [(p.arg, "keyword", _NoDefault if d is None else _literal(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "**", _NoDefault))
    return out


class _NoDefault:
    pass


def signature_text(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool = False) -> str:
    shown = []
    for name, kind, default in _params(fn, bound):
        prefix = {"*": "*", "**": "**"}.get(kind, "")
        suffix = "" if default is _NoDefault else "=" + ("…" if default is _Unevaluated else repr(default))
        shown.append(f"{prefix}{name}{suffix}")
    return f"{fn.name}({', '.join(shown)})"


def _is_method(found: Found) -> bool:
    return found.kind == "function" and ".".join(found.qual.split(".")[:-1]) != found.module


def binding_problem(found: Found, shape: CallShape, sources: Sources) -> str | None:
    """Why a call of that shape cannot bind to `found` (a function, or a class through its
    ``__init__``), or None. Calls through ``*args``/``**kwargs`` are only checked for keywords."""
    fn: ast.AST | None = found.node
    bound = _is_method(found) and not any(
        isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(fn, "decorator_list", []))
    if found.kind == "class":
        init = sources.class_member(found, "__init__", instance=False)
        if not isinstance(init, Found) or init.kind != "function":
            return None  # an inherited constructor outside the sources: not checked
        fn, bound = init.node, True
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    params = _params(fn, bound)
    positional = [p for p in params if p[1] in ("posonly", "positional")]
    names = {p[0] for p in params if p[1] in ("positional", "keyword")}
    has_var, has_kw = any(p[1] == "*" for p in params), any(p[1] == "**" for p in params)
    text = signature_text(fn, bound)
    if shape.positional > len(positional) and not has_var:
        return f"{shape.positional} positional arguments, but {text} takes {len(positional)}"
    for k in shape.keywords:
        if k not in names and not has_kw:
            return f"keyword {k!r}, but {text} has no such parameter"
        if k in [p[0] for p in positional[: shape.positional]]:
            return f"{k!r} given twice to {text}"
    if not (shape.star_args or shape.star_kwargs):
        covered = {p[0] for p in positional[: shape.positional]} | set(shape.keywords)
        required = [p[0] for p in params if p[2] is _NoDefault and p[1] in ("posonly", "positional", "keyword")]
        absent = [r for r in required if r not in covered]
        if absent:
            return f"no value for {', '.join(absent)} of {text}"
    return None


def signature_difference(stand_in: ast.FunctionDef, real: ast.FunctionDef, bound: bool) -> str | None:
    """None when both take the same parameters (names, kinds, order, which have defaults, literal
    default values), else both signatures."""
    mine, theirs = _params(stand_in, bound), _params(real, bound)
    same = len(mine) == len(theirs) and all(
        a[0] == b[0] and a[1] == b[1] and (a[2] is _NoDefault) == (b[2] is _NoDefault)
        and (a[2] == b[2] or _Unevaluated in (a[2], b[2]) or a[2] is _NoDefault)
        for a, b in zip(mine, theirs))
    return None if same else f"stand-in {signature_text(stand_in, bound)} vs real {signature_text(real, bound)}"


# ---------------------------------------------------------------------------------------------- glmlight's uses

ROOTS = ("torch_npu", "torch", "vllm_ascend", "vllm")


@dataclass(frozen=True)
class Use:
    qual: str  # e.g. torch.npu.set_device, vllm_ascend.ascend_config.get_ascend_config().weight_nz_mode
    where: str  # path:line
    shape: CallShape | None = None  # the call's shape, when the name is called
    optional: bool = False  # looked up with getattr(..., default) / hasattr: may be absent


def module_name(path: Path, repo: Path) -> str:
    rel = path.relative_to(repo).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rooted(qual: str | None) -> bool:
    return bool(qual) and qual.split(".")[0] in ROOTS  # type: ignore[union-attr]


class _Scope:
    """Names bound in a module or function: imports, and variables assigned a rooted value."""

    def __init__(self, module: str, parent: _Scope | None, returns: dict[str, str]):
        self.module, self.parent, self.returns = module, parent, returns
        self.names: dict[str, str] = {}
        self.local_functions: set[str] = set()

    def lookup(self, name: str) -> str | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def bind_imports(self, stmt: ast.stmt, relative: callable) -> None:  # type: ignore[valid-type]
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    self.names[alias.asname] = alias.name
                else:
                    self.names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(stmt, ast.ImportFrom):
            source = relative(stmt.level, stmt.module)
            for alias in stmt.names:
                if alias.name != "*":
                    self.names[alias.asname or alias.name] = f"{source}.{alias.name}"

    def qual(self, expr: ast.AST) -> str | None:
        """The dotted name `expr` stands for (``f()`` for a call's result), or None."""
        if isinstance(expr, ast.Name):
            return self.lookup(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.qual(expr.value)
            return f"{base}.{expr.attr}" if base else None
        if isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and len(expr.args) >= 2:
                base, attr = self.qual(expr.args[0]), _literal(expr.args[1])
                return f"{base}.{attr}" if base and isinstance(attr, str) else None
            func = self.qual(expr.func)
            if func is None:
                return None
            if func in self.returns:
                return self.returns[func]
            return f"{func}()" if _rooted(func) else None
        if isinstance(expr, ast.IfExp):
            return self.qual(expr.body) or self.qual(expr.orelse)
        if isinstance(expr, ast.BoolOp):
            for value in expr.values:
                got = self.qual(value)
                if got:
                    return got
        return None


class _Collector:
    def __init__(self, repo: Path, files: list[Path]):
        self.repo = repo
        self.trees = {module_name(f, repo): (f, ast.parse(f.read_text(encoding="utf-8-sig"), str(f))) for f in files}
        self.returns: dict[str, str] = {}  # glmlight function → the rooted name it returns
        self._statements: dict[ast.AST, list[ast.stmt]] = {}  # a function's imports and assignments

    def relative_for(self, module: str, path: Path):
        package = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]

        def relative(level: int, name: str | None) -> str:
            if level == 0:
                return name or ""
            base = package[: len(package) - (level - 1)]
            return ".".join(base + ([name] if name else []))

        return relative

    def module_scope(self, module: str) -> _Scope:
        path, tree = self.trees[module]
        scope = _Scope(module, None, self.returns)
        relative = self.relative_for(module, path)
        for stmt in _top_level(tree.body):
            scope.bind_imports(stmt, relative)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scope.local_functions.add(stmt.name)
                scope.names.setdefault(stmt.name, f"{module}.{stmt.name}")
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.Assign):
                got = scope.qual(stmt.value)
                if _rooted(got):
                    for name in _assigned_names(stmt):
                        scope.names.setdefault(name, got)  # type: ignore[arg-type]
        return scope

    def function_scope(self, fn: ast.AST, parent: _Scope, relative) -> _Scope:
        if fn not in self._statements:
            nodes = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign))]
            self._statements[fn] = nodes
        scope = _Scope(parent.module, parent, self.returns)
        for stmt in self._statements[fn]:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                scope.bind_imports(stmt, relative)
        for _ in range(2):  # a variable assigned from another one
            for stmt in self._statements[fn]:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    got = scope.qual(stmt.value)
                    if _rooted(got):
                        for name in _assigned_names(stmt):
                            scope.names.setdefault(name, got)  # type: ignore[arg-type]
        return scope

    def functions(self, tree: ast.Module) -> Iterator[tuple[ast.AST, str | None]]:
        """Every function (with its module-level name when it has one)."""
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield stmt, stmt.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node not in tree.body:
                yield node, None

    def compute_returns(self) -> None:
        returning = {module: [(fn, name) for fn, name in self.functions(tree) if name is not None and any(
            isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))]
            for module, (_, tree) in self.trees.items()}
        while True:  # until no function is found to return what another one returns
            before = dict(self.returns)
            for module, (path, _) in self.trees.items():
                if not returning[module]:
                    continue
                outer = self.module_scope(module)
                relative = self.relative_for(module, path)
                for fn, name in returning[module]:
                    scope = self.function_scope(fn, outer, relative)
                    for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
                        got = scope.qual(ret.value)
                        if _rooted(got):
                            self.returns.setdefault(f"{module}.{name}", got)  # type: ignore[arg-type]
            if self.returns == before:
                return

    def uses(self) -> list[Use]:
        self.compute_returns()
        found: dict[tuple[str, CallShape | None, bool], Use] = {}
        for module, (path, tree) in self.trees.items():
            outer = self.module_scope(module)
            relative = self.relative_for(module, path)
            where = str(path.relative_to(self.repo))
            scopes: list[tuple[ast.AST, _Scope]] = [(tree, outer)]
            scopes += [(fn, self.function_scope(fn, outer, relative)) for fn, _ in self.functions(tree)]
            owner: dict[ast.AST, _Scope] = {}
            for node, scope in scopes:  # innermost function wins: visited later
                for child in ast.walk(node):
                    owner[child] = scope
            for node in ast.walk(tree):
                for use in self._uses_at(node, owner.get(node, outer), relative, where):
                    found.setdefault((use.qual, use.shape, use.optional), use)
        return sorted(found.values(), key=lambda u: (u.qual, u.where))

    def _uses_at(self, node: ast.AST, scope: _Scope, relative, where: str) -> Iterator[Use]:
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _rooted(alias.name):
                    yield Use(alias.name, at)
        elif isinstance(node, ast.ImportFrom):
            source = relative(node.level, node.module)
            if _rooted(source):
                for alias in node.names:
                    yield Use(source if alias.name == "*" else f"{source}.{alias.name}", at)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                qual = scope.qual(node)
                if not qual and node.func.id == "hasattr":
                    base, attr = scope.qual(node.args[0]), _literal(node.args[1])
                    qual = f"{base}.{attr}" if base and isinstance(attr, str) else None
                if _rooted(qual):
                    yield Use(qual, at, optional=node.func.id == "hasattr" or len(node.args) > 2)  # type: ignore[arg-type]
            else:
                qual = scope.qual(node.func)
                if _rooted(qual) and qual not in self.returns:
                    yield Use(qual, at, call_shape(node))  # type: ignore[arg-type]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            qual = scope.qual(node)
            if _rooted(qual):
                yield Use(qual, at)  # type: ignore[arg-type]


def collect_uses(repo: Path, files: Iterable[Path]) -> list[Use]:
    """Every name under `ROOTS` glmlight's `files` use; a bare name that is also called, or that
    is the prefix of a longer use, is dropped."""
    uses = _Collector(repo, sorted(files)).uses()
    longer = {u.qual for u in uses}
    prefixes = {".".join(q.split(".")[:i]) for q in longer for i in range(1, q.count(".") + 1)}
    called = {u.qual for u in uses if u.shape is not None}
    return [u for u in uses if u.shape is not None or u.optional or (u.qual not in prefixes and u.qual not in called)]


def self_uses(cls: ast.ClassDef) -> list[tuple[tuple[str, ...], CallShape | None, bool, int]]:
    """Attribute chains on ``self`` in a class's methods (``self.a.b()`` → ("a", "b"), with the call's
    shape), ``getattr(self.a, "b", default)`` marked optional; the longest chain at each place."""
    out = []

    def chain(expr: ast.AST) -> tuple[str, ...] | None:
        if isinstance(expr, ast.Name) and expr.id == "self":
            return ()
        if isinstance(expr, ast.Attribute):
            base = chain(expr.value)
            return None if base is None else base + (expr.attr,)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" \
                and len(expr.args) >= 2 and isinstance(_literal(expr.args[1]), str):
            base = chain(expr.args[0])
            return None if base is None else base + (str(_literal(expr.args[1])),)
        if isinstance(expr, ast.Call):  # self.a.b().c: the call's result
            base = chain(expr.func)
            return None if not base else base[:-1] + (base[-1] + "()",)
        return None

    inner: set[int] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Attribute, ast.Call)):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Attribute, ast.Call)) and not (
                        isinstance(node, ast.Call) and child in node.args + [k.value for k in node.keywords]):
                    inner.add(id(child))
    for node in ast.walk(cls):
        if id(node) in inner or not isinstance(node, (ast.Attribute, ast.Call)):
            continue
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            continue
        got = chain(node)
        if not got:
            continue
        is_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        if isinstance(node, ast.Call) and not is_getattr:
            got = got[:-1] + (got[-1][:-2],)
            out.append((got, call_shape(node), False, node.lineno))
        else:
            out.append((got, None, is_getattr and len(node.args) > 2, node.lineno))
    return out


# ---------------------------------------------------------------------------------------------- stand-ins


@dataclass(frozen=True)
class Definition:
    qual: str  # the module path a caller would use, e.g. torch_npu.npu.utils.set_device
    where: str
    node: ast.AST | None  # the def/class, or None for a module or an assigned value


def public_definitions(package_dir: Path, repo: Path) -> tuple[list[Definition], dict[str, set[str]]]:
    """The public modules and names a stand-in package defines (def, class, assignment, or a re-export
    of one of its own names), and each module's ``__standin_only__`` names (its test hooks)."""
    defs: list[Definition] = []
    hooks: dict[str, set[str]] = {}
    top = package_dir.name
    for path in sorted(package_dir.rglob("*.py")):
        module = module_name(path, package_dir.parent)
        if any(part.startswith("_") for part in module.split(".")[1:]):
            continue  # a private module of the stand-in
        where = str(path.relative_to(repo))
        defs.append(Definition(module, where, None))
        tree = ast.parse(path.read_text(encoding="utf-8-sig"), str(path))
        only: set[str] = set()
        for stmt in _top_level(tree.body):
            if "__standin_only__" in _assigned_names(stmt):
                only = set(_literal(stmt.value))  # type: ignore[arg-type]
        hooks[module] = only
        for stmt in _top_level(tree.body):
            names: list[tuple[str, ast.AST | None]] = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [(stmt.name, stmt)]
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                names = [(n, None) for n in _assigned_names(stmt)]
            elif isinstance(stmt, ast.ImportFrom) and (stmt.level or (stmt.module or "").split(".")[0] == top):
                names = [(a.asname or a.name, None) for a in stmt.names if a.name != "*"]
            for name, node in names:
                if not name.startswith("_") and name not in only:
                    defs.append(Definition(f"{module}.{name}", f"{where}:{stmt.lineno}", node))
    return defs, hooks


# ---------------------------------------------------------------------------------------------- torch_npu operators


def _schema_to_def(name: str, params: str) -> ast.FunctionDef | None:
    """``Tensor query, int head_num, float scale=1., *, bool sync=False`` as a Python ``def``."""
    parts, depth, current = [], 0, ""
    for ch in params:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    shown = []
    for part in filter(None, parts):
        if part == "*":
            shown.append("*")
            continue
        declaration, _, default = part.partition("=")
        pname = declaration.split()[-1]
        shown.append(f"{pname}={default.strip()}" if default else pname)
    try:
        fn = ast.parse(f"def {name}({', '.join(shown)}): pass").body[0]
    except SyntaxError:
        return None
    return fn if isinstance(fn, ast.FunctionDef) else None


def torch_npu_operators(sources: Sources) -> dict[str, Found]:
    """torch_npu's top-level operator functions. ``import torch_npu`` copies every operator of
    ``torch.ops.npu`` (compiled, registered from C++) onto the torch_npu module
    (torch_npu/_init/core/_exports.py); their Python-level declarations are the list of public ones,
    ``public_npu_functions`` in torch_npu/utils/exposed_api.py, and each one's signature line
    ``torch_npu.<name>(<schema>) -> …`` in the docstrings of torch_npu/_op_plugin_docs.py."""
    exposed = sources.module("torch_npu.utils.exposed_api")
    names: list[str] = []
    for stmt in _top_level(exposed.body if exposed else []):
        if "public_npu_functions" in _assigned_names(stmt):
            names = list(_literal(stmt.value))  # type: ignore[arg-type]
    signatures: dict[str, ast.FunctionDef] = {}
    docs = sources.module("torch_npu._op_plugin_docs")
    for call in calls_named(docs, "_add_torch_npu_docstr") if docs else []:
        name, text = _literal(call.args[0]), _literal(call.args[1]) if len(call.args) > 1 else None
        if isinstance(name, str) and isinstance(text, str):
            match = re.search(rf"torch_npu\.{re.escape(name)}\((.*)\)\s*->", text)
            fn = _schema_to_def(name, match.group(1)) if match else None
            if fn is not None:
                signatures[name] = fn
    return {name: Found("function" if name in signatures else "value", f"torch_npu.{name}", "torch_npu",
                        signatures.get(name), how="torch.ops.npu operator (exposed_api.py, _op_plugin_docs.py)")
            for name in names}


# ---------------------------------------------------------------------------------------------- odds and ends


def string_assignments(tree: ast.Module, attribute: str) -> list[str]:
    """String constants assigned to ``<anything>.<attribute>`` in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Attribute) and t.attr == attribute for t in node.targets):
                out.append(node.value.value)
    return out


def calls_named(tree: ast.AST, dotted_suffix: str) -> list[ast.Call]:
    """Calls whose function is spelt ``….<dotted_suffix>`` (or exactly that)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            if name == dotted_suffix or name.endswith("." + dotted_suffix):
                out.append(node)
    return out


def dict_keys(tree: ast.Module, variable: str) -> set[str]:
    """The string keys of the dict literal assigned to module variable `variable`."""
    for stmt in _top_level(tree.body):
        if variable in _assigned_names(stmt) and isinstance(getattr(stmt, "value", None), ast.Dict):
            return {k.value for k in stmt.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def literal(node: ast.AST | None) -> object:
    """``ast.literal_eval`` of a node, or a marker object when it is not a literal."""
    return _literal(node)


@dataclass
class Report:
    """Problems found, one line each."""

    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)
