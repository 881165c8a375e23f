"""Codec names are spelled only in the codec registry; everything else asks the catalog (issue 9).

The check walks the AST of every ``.py`` file under ``mapl_swarm/`` and ``bench/`` and reports, as
``file:line: code``, each *codec-name comparison* outside the registry files (:data:`REGISTRY`).
Its heuristic, exactly:

- a comparison is an ``ast.Compare`` operand pair joined by ``==``, ``!=``, ``in`` or ``not in``
  (chained comparisons are split into pairs), or a ``match`` statement with its ``case`` patterns;
- one operand is a *codec-name literal*: a ``str`` constant equal to a name in
  :data:`~mapl_swarm.config.catalog.CODEC_NAMES`; a tuple / list / set display with such a
  constant among its elements (also wrapped in ``tuple()``, ``list()``, ``set()`` or ``frozenset()``);
  or a bare name that the same file assigns such a collection to (``ANCHORED = ("mapl", ...)`` then
  ``codec in ANCHORED``). In a ``case`` pattern: a value pattern with such a constant, alone or
  inside ``|``, sequence, mapping or class patterns;
- the other operand (the ``match`` subject) mentions ``codec`` anywhere in its source, case-blind:
  ``codec == "x"``, ``cfg.compression.codec in (...)``, ``r["codec"] != ...``, ``a.codec``,
  ``out.codec``, ``r["codec"].split(":")[0] == ...``, ``codec_info(c).family != "ssn"``;
- also a ``for`` loop or comprehension iterating directly over a collection display of codec
  names (``for c in ("none", "mapl")``): picking codecs by name. Every element must be a codec name,
  unless the loop variable mentions ``codec`` (so ``for anchor in ("none", "static")`` passes).

So comparisons of other names that happen to equal a codec name (``anchor == "none"``) pass, and
so does a codec name held in a variable whose source does not say ``codec`` (``c == "mapl"``), a
collection imported from another module or read through an attribute (``mod.ANCHORED``), a dict
keyed by codec names, or ``str.startswith`` — the check is a tripwire for the common shapes of
string dispatch, not a proof. Codec names as data (config values, grid defaults, docstrings) are fine.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from mapl_swarm.config.catalog import CODEC_INFO, CODEC_NAMES, codec_info, uncompressed_codec

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("mapl_swarm", "bench")
"""Folders whose Python files are checked."""
REGISTRY = {"mapl_swarm/config/catalog.py", "mapl_swarm/compress/codecs.py"}
"""The only files allowed to compare against codec names."""
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _is_codec_collection(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 \
            and node.func.id in ("tuple", "list", "set", "frozenset"):
        node = node.args[0]
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
        isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in CODEC_NAMES for e in node.elts)


def _all_codec_names(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        node = node.args[0]
    return all(isinstance(e, ast.Constant) and e.value in CODEC_NAMES for e in node.elts)


def _is_codec_literal(node: ast.AST, aliases: frozenset[str] = frozenset()) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in CODEC_NAMES
    if isinstance(node, ast.Name):
        return node.id in aliases
    return _is_codec_collection(node)


def _codec_aliases(tree: ast.AST) -> frozenset[str]:
    """Names the file assigns a codec-name collection to."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_codec_collection(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_codec_collection(node.value) \
                and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _mentions_codec(node: ast.AST) -> bool:
    return "codec" in ast.unparse(node).lower()


def _pattern_has_codec_literal(pattern: ast.pattern) -> bool:
    if isinstance(pattern, ast.MatchValue):
        return _is_codec_literal(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return any(_pattern_has_codec_literal(p) for p in pattern.patterns)
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _pattern_has_codec_literal(pattern.pattern)
    if isinstance(pattern, ast.MatchSequence):
        return any(_pattern_has_codec_literal(p) for p in pattern.patterns)
    if isinstance(pattern, ast.MatchClass):
        return any(_pattern_has_codec_literal(p) for p in (*pattern.patterns, *pattern.kwd_patterns))
    if isinstance(pattern, ast.MatchMapping):
        return any(_pattern_has_codec_literal(p) for p in pattern.patterns)
    return False


def codec_comparisons(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, code) of every codec-name comparison in ``source`` (see the module docstring)."""
    found = []
    tree = ast.parse(source, filename)
    aliases = _codec_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                if not isinstance(op, _OPS):
                    continue
                if ((_is_codec_literal(left, aliases) and _mentions_codec(right))
                        or (_is_codec_literal(right, aliases) and _mentions_codec(left))):
                    found.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and _is_codec_collection(node.iter) \
                and (_mentions_codec(node.target) or _all_codec_names(node.iter)):
            found.append((node.iter.lineno, f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"))
        elif isinstance(node, ast.Match) and _mentions_codec(node.subject):
            for case in node.cases:
                if _pattern_has_codec_literal(case.pattern):
                    found.append((case.pattern.lineno, f"match {ast.unparse(node.subject)}: "
                                                       f"case {ast.unparse(case.pattern)}"))
    return sorted(found)


def _scanned_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for d in SCANNED for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", [p for p in _scanned_files() if p not in REGISTRY])
def test_no_codec_name_comparison_outside_registry(path):
    hits = codec_comparisons((ROOT / path).read_text(), path)
    assert not hits, (
        f"{len(hits)} codec-name comparison(s) outside the codec registry ({', '.join(sorted(REGISTRY))}); "
        "ask mapl_swarm.config.catalog.codec_info(name) (or the codec object) instead:\n"
        + "\n".join(f"  {path}:{line}: {code}" for line, code in hits))


def test_checker_finds_the_shapes_it_promises():
    flagged = """
codec == "mapl"
"none" != cfg.compression.codec
cfg.compression.codec in ("mapl", "fixed")
r["codec"] not in ["ssn"]
a.codec in {"mapl_vq", "x"}
out.codec == "naive"
r["codec"].split(":")[0] == "none"
0 < codec_count == "ssn"
f"{'-' if codec == 'none' else 'x'}"
match cfg.codec:
    case "ssn" | "other":
        pass
match self.codec:
    case Foo(kind="mapl"):
        pass
PROJECTED = ("mapl", "fixed")
codec in PROJECTED
TRAINED: frozenset = frozenset({"naive"})
cfg.codec not in TRAINED
picks = [pick(c) for c in ("none", "mapl")]
for name in ["fixed"]:
    pass
for codec in ("none", "other"):
    pass
"""
    passed = """
anchor == "none"
cfg.compression.anchor != "none"
codec == name
codec_info(codec).uncompressed
r["codec"] == uncompressed_codec()
kind in ("none", "static")
"mapl" == "mapl"
codec < "mapl"
codec == "mapl_vqq"
match anchor:
    case "none":
        pass
match codec:
    case "something_else":
        pass
ANCHORS = ("none", "static")
anchor in ANCHORS
codec in mod.PROJECTED
for anchor in ("static", "full"):
    pass
"""
    assert [line for line, _ in codec_comparisons(flagged)] == [2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 18, 20, 21, 22, 24]
    assert codec_comparisons(passed) == []


def test_scan_covers_the_package_and_bench():
    assert (ROOT / "mapl_swarm/config/catalog.py").exists()
    scanned = set(_scanned_files())
    assert "mapl_swarm/experiments/tables.py" in scanned and "bench/quality.py" in scanned


def _config_codec_names() -> tuple[str, ...] | None:
    """The codec names the config module enumerates, whatever it calls them (None if it does not)."""
    from mapl_swarm import config

    for attr in ("CODEC_NAMES", "CODECS"):
        names = getattr(config, attr, None)
        if names is not None:
            return tuple(names)
    for cls in vars(config).values():  # a Literal-typed ``codec`` field of a config dataclass
        if isinstance(cls, type) and "codec" in getattr(cls, "__dataclass_fields__", {}):
            args = typing.get_args(typing.get_type_hints(cls).get("codec"))
            if args:
                return tuple(args)
    return None


def test_catalog_names_are_the_config_codecs():
    from mapl_swarm.config import config_from_dict
    from mapl_swarm.errors import ConfigError

    names = _config_codec_names()
    if names is not None:
        assert set(names) == set(CODEC_NAMES)
    for name in CODEC_NAMES:  # the config accepts every catalog codec, and nothing else
        assert config_from_dict({"compression": {"codec": name}}).compression.codec == name
    with pytest.raises(ConfigError):
        config_from_dict({"compression": {"codec": "not-a-codec"}})


def test_catalog_report_roles_are_consistent():
    assert sum(i.uncompressed for i in CODEC_INFO.values()) == 1
    assert sum(i.headline for i in CODEC_INFO.values()) == 1
    assert codec_info(uncompressed_codec()).baseline and not codec_info(uncompressed_codec()).projected
    orders = [i.order for i in CODEC_INFO.values()]
    assert len(set(orders)) == len(orders)
    assert len({i.display_name for i in CODEC_INFO.values()}) == len(CODEC_INFO)
    for i in CODEC_INFO.values():
        assert i.color
        assert not (i.paper_projector_delta_pct is not None and not i.projector_label), i.name
        assert not (i.paper_delta_pct and i.paper_ratio is None), i.name
    with pytest.raises(ValueError, match="unknown codec"):
        codec_info("not-a-codec")
