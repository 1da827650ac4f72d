"""The Lua library says what it uses and what it touches, and still loads as one library.

* The include resolver of ``tq_redis/server/library.py``: dependencies first, each include once, a clear
  error for a missing include or a cycle; a change of any source changes the library version.
* Every file declares (``-- @include``) the includes whose functions and constants it uses.
* Every script's ``Touches:`` header lists exactly the key kinds it reads or writes, derived here
  from the source: string literals concatenated to the prefix (``prefix .. 'prod:' .. f``),
  ``KEYS[n]``, and, transitively, the key kinds of the include helpers it calls.
* The concatenated library stays within Lua 5.1's limits (200 locals in the main chunk, 60
  upvalues per function) and loads into a server (fakeredis in-process here; the integration
  tests run every script on Valkey and Redis 7.0).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import fakeredis
import pytest
from redis.crc import key_slot

from tq_redis.meta.keys import ChannelKeys, PartitionKeys
from tq_redis.server import library as scripts
from tq_redis.server.library import IncludeError, declared_includes, include_order

LUA = Path(__file__).resolve().parents[2] / "tq_redis" / "lua"
LUA_MAX_LOCALS = 200  # LUAI_MAXVARS: active locals of one function (the library's main chunk)
LUA_MAX_UPVALUES = 60  # LUAI_MAXUPVALUES: outer locals one function may use
#: what the header's ``KEYS[1]`` line names -> (namespace, key kind) of KEYS[1]: the partition's or the
#: channel's meta key, or a key of the namespace itself (``<ns>:storage:nodes``)
KEYS1_PATTERNS = (
    (re.compile(r"<ns>:\{<ns>/<p>\}:meta$"), ("p", "meta")),
    (re.compile(r"<ns>:chan:\{<ns>/<name>\}:meta$"), ("c", "meta")),
    (re.compile(r"<ns>:(?!.*[{}])(\S+)$"), ("ns", None)),
)


# ---------------------------------------------------------------------------------------------
# Reading Lua source
# ---------------------------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    """The source with every comment blanked (newlines kept), string literals left as they are."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "'\"":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("--[[", i):
            j = text.find("]]", i)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("--", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def strip_strings(code: str) -> str:
    """Comment-free code with the contents of every string literal removed."""
    return re.sub(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"", "''", code)


TOP_LEVEL_LOCAL = re.compile(r"^local\s+(?:function\s+(\w+)|([\w\s,]+?)\s*=)", re.MULTILINE)


def top_level_names(code: str) -> list[tuple[int, list[str]]]:
    """``(offset, names)`` of each top-level ``local`` declaration (column 0) of comment-free code."""
    found = []
    for m in TOP_LEVEL_LOCAL.finditer(code):
        names = [m.group(1)] if m.group(1) else [s.strip() for s in m.group(2).split(",")]
        found.append((m.start(), names))
    return found


STRING = r"'((?:\\.|[^'\\])*)'|\"((?:\\.|[^\"\\])*)\""
OPERAND = r"[A-Za-z_][\w.]*(?:\[[^\]]*\])?"
CONCAT = re.compile(r"\s*\.\.(?!\.)\s*(?:" + STRING + "|(" + OPERAND + "))")


def prefix_keys(code: str) -> tuple[set[str], list[str]]:
    """Key kinds built as ``prefix .. 'lit' .. var ..``: each variable part becomes ``*``.

    Returns the kinds and the chains that do not start with a literal (their kind is unknown).
    """
    kinds: set[str] = set()
    unknown: list[str] = []
    for m in re.finditer(r"(?<![\w.])prefix\b", code):
        parts: list[str] = []
        at = m.end()
        while (c := CONCAT.match(code, at)) is not None:
            literal = c.group(1) if c.group(1) is not None else c.group(2)
            parts.append(literal if literal is not None else "*")
            at = c.end()
        if not parts:
            continue  # prefix passed on (to a helper) or returned, not a key built here
        if parts[0] == "*":
            unknown.append(code[m.start() : at])
            continue
        kinds.add(re.sub(r"\*+", "*", "".join(parts)))
    return kinds, unknown


def keys_kinds(code: str, keys1: str = "meta") -> set[str]:
    """Key kinds of ``KEYS[n]`` used as a key (not only to derive the prefix); KEYS[1]'s is ``keys1``."""
    code = re.sub(r"\b(?:partition|channel)_prefix\(KEYS\[1\]\)", "", code)
    return {keys1 if n == "1" else f"KEYS[{n}]" for n in re.findall(r"\bKEYS\[(\d+)\]", code)}


def keys1_of(text: str) -> tuple[str, str] | None:
    """(namespace, key kind) of KEYS[1] as the header's Input section names it (None: no KEYS)."""
    body = section(header(text), "Input") if text.lstrip().startswith("--[[") else None
    m = re.search(r"^\s*KEYS\[1\].*?(<ns>\S*)\s*$", body or "", re.MULTILINE)
    if m is None:
        return None
    for pattern, (ns, kind) in KEYS1_PATTERNS:
        found = pattern.search(m.group(1))
        if found:
            return ns, kind or found.group(1)
    raise AssertionError(f"KEYS[1] is {m.group(1)!r}: not a partition's, a channel's or a namespace's key")


def identifiers(code: str) -> set[str]:
    """Names used in comment-free code, leaving out fields (``table.insert``, ``opts.n``)."""
    return set(re.findall(r"(?<![\w.:])([A-Za-z_]\w*)", strip_strings(code)))


def header(text: str) -> str:
    m = re.match(r"\s*--\[\[(.*?)\]\]", text, re.DOTALL)
    assert m, "a Lua file must open with a --[[ ... ]] header comment"
    return m.group(1)


def section(head: str, name: str) -> str | None:
    """Text of a header section (``  Name:`` up to the next ``  Other:`` at the same indent)."""
    m = re.search(rf"^  {name}:(.*?)(?=^  [A-Z]\w*:|\Z)", head, re.DOTALL | re.MULTILINE)
    return m.group(1) if m else None


def touches_listed(text: str) -> set[tuple[str, str]] | None:
    """``(namespace, pattern)`` of every ``<p>:kind`` / ``<c>:kind`` / ``<ns>:kind`` in the Touches section."""
    body = section(header(text), "Touches")
    if body is None:
        return None
    out = set()
    for ns, key in re.findall(r"<(p|c|ns)>:([^\s,;)]+)", body):
        out.add((ns, re.sub(r"<[^>]*>", "*", key)))
    return out


# ---------------------------------------------------------------------------------------------
# The model of the library: files, their symbols, what each symbol touches and uses
# ---------------------------------------------------------------------------------------------


@dataclass
class LuaFile:
    name: str  # "claim" or "includes/bits"
    text: str
    code: str = ""
    namespace: str = "p"  # "p": partition keys, "c": channel keys, "ns": keys of the namespace itself
    keys1: str = "meta"  # the kind of KEYS[1]
    symbols: dict[str, str] = field(default_factory=dict)  # top-level name -> its code segment

    @property
    def include(self) -> str | None:
        return self.name.removeprefix("includes/") if self.name.startswith("includes/") else None


def load(name: str, text: str) -> LuaFile:
    code = strip_comments(text)
    f = LuaFile(name, text, code)
    decls = top_level_names(code)
    for k, (start, names) in enumerate(decls):
        end = decls[k + 1][0] if k + 1 < len(decls) else len(code)
        for sym in names:
            f.symbols[sym] = code[start:end]
    channel = (f.include == "channel") or "channel_prefix(" in code
    f.namespace = "c" if channel else "p"
    if f.include is None and (keys1 := keys1_of(text)) is not None:
        f.namespace, f.keys1 = keys1
    return f


@dataclass
class Library:
    scripts: dict[str, LuaFile]
    includes: dict[str, LuaFile]  # by include name
    defined_in: dict[str, str]  # include symbol -> include name
    memo: dict[str, frozenset[tuple[str, str]]] = field(default_factory=dict)

    def own_keys(self, f: LuaFile, code: str) -> set[tuple[str, str]]:
        kinds, _ = prefix_keys(code)
        return {(f.namespace, k) for k in kinds | keys_kinds(code, f.keys1)}

    def uses(self, code: str) -> set[str]:
        """Include symbols a piece of code refers to."""
        return identifiers(code) & self.defined_in.keys()

    def symbol_touches(self, sym: str) -> frozenset[tuple[str, str]]:
        """Key kinds of an include symbol, with those of the symbols it uses (transitively)."""
        if sym in self.memo:
            return self.memo[sym]
        seen, todo, out = {sym}, [sym], set()
        while todo:
            s = todo.pop()
            inc = self.includes[self.defined_in[s]]
            out |= self.own_keys(inc, inc.symbols[s])
            for used in self.uses(inc.symbols[s]) - seen:
                seen.add(used)
                todo.append(used)
        self.memo[sym] = frozenset(out)
        return self.memo[sym]

    def touches(self, f: LuaFile) -> set[tuple[str, str]]:
        """Key kinds a script (or a whole include) touches, its helpers' included."""
        out = self.own_keys(f, f.code) if f.include is None else set()
        for sym in self.uses(f.code):
            out |= self.symbol_touches(sym)
        return out

    def direct_needs(self, f: LuaFile) -> set[str]:
        """Includes defining the symbols a file uses itself."""
        return {self.defined_in[s] for s in self.uses(f.code)} - {f.include}

    def reachable(self, f: LuaFile) -> set[str]:
        """Includes a file gets through its ``@include`` lines, transitively."""
        seen: set[str] = set()
        todo = list(declared_includes(f.text))
        while todo:
            name = todo.pop()
            if name not in seen and name in self.includes:
                seen.add(name)
                todo.extend(declared_includes(self.includes[name].text))
        return seen


@lru_cache(maxsize=1)
def library_model() -> Library:
    scripts_ = {p.stem: load(p.stem, p.read_text(encoding="utf-8")) for p in sorted(LUA.glob("*.lua"))}
    incs = {
        p.stem: load(f"includes/{p.stem}", p.read_text(encoding="utf-8")) for p in sorted(LUA.glob("includes/*.lua"))
    }
    defined_in: dict[str, str] = {}
    for name, inc in incs.items():
        for sym in inc.symbols:
            assert sym not in defined_in, f"{sym} is defined in both includes/{defined_in[sym]} and includes/{name}"
            defined_in[sym] = name
    return Library(scripts_, incs, defined_in)


def all_files() -> list[LuaFile]:
    lib = library_model()
    return [*lib.scripts.values(), *lib.includes.values()]


def show(kinds: set[tuple[str, str]]) -> list[str]:
    return sorted(f"<{ns}>:{k}" for ns, k in kinds)


# ---------------------------------------------------------------------------------------------
# The include resolver
# ---------------------------------------------------------------------------------------------


def test_include_order_puts_dependencies_first_and_each_once():
    available = {"a": [], "b": ["a"], "c": ["b", "a"], "d": []}
    order = include_order({"s2": ["c"], "s1": ["b", "d"]}, available)
    assert order == ["a", "b", "d", "c"]  # s1 first (name order), each include after its deps


def test_include_order_leaves_out_includes_no_script_needs():
    assert include_order({"s": ["a"]}, {"a": [], "unused": []}) == ["a"]


def test_missing_include_names_the_declaring_file():
    with pytest.raises(IncludeError, match=r"lua/includes/b\.lua has '-- @include nope'.*no lua/includes/nope\.lua"):
        include_order({"s": ["b"]}, {"b": ["nope"]})
    with pytest.raises(IncludeError, match=r"lua/s\.lua has '-- @include gone'"):
        include_order({"s": ["gone"]}, {})


def test_include_cycle_is_reported_with_its_loop():
    with pytest.raises(IncludeError, match=r"include cycle: a -> b -> c -> a"):
        include_order({"s": ["a"]}, {"a": ["b"], "b": ["c"], "c": ["a"]})
    with pytest.raises(IncludeError, match=r"include cycle: a -> a"):
        include_order({"s": ["a"]}, {"a": ["a"]})


def test_declared_includes_reads_include_lines_only():
    text = "--[[\n  header\n]]\n-- @include bits\n--  @include   chunks  \n-- uses @include inline\nlocal x = 1\n"
    assert declared_includes(text) == ["bits", "chunks"]


def test_library_loads_every_include_after_the_includes_it_declares():
    order = scripts.includes()
    lib = library_model()
    assert len(order) == len(set(order))
    for at, name in enumerate(order):
        for dep in declared_includes(lib.includes[name].text):
            assert order.index(dep) < at, f"includes/{dep} must load before includes/{name}"


def test_include_graph_names_every_file_and_its_includes():
    lib = library_model()
    graph = scripts.include_graph()
    assert set(graph) == set(lib.scripts) | {f"includes/{name}" for name in lib.includes}
    assert graph["claim"] == declared_includes(lib.scripts["claim"].text)


def test_every_include_is_used_by_some_script():
    assert set(scripts.includes()) == set(library_model().includes)


def test_version_changes_with_any_source(monkeypatch):
    original_sources = scripts._sources
    base = scripts.library.__wrapped__()[1]

    def edited(which: str):
        def sources():
            found_scripts, found_includes = original_sources()
            target = found_scripts if which == "script" else found_includes
            name = "claim" if which == "script" else "bits"
            target[name] = target[name] + "\n-- edited\n"
            return found_scripts, found_includes

        return sources

    for which in ("script", "include"):
        monkeypatch.setattr(scripts, "_sources", edited(which))
        assert scripts.library.__wrapped__()[1] != base, f"an edited {which} must change the version"


def test_library_registers_every_script_and_loads():
    source, version = scripts.library()
    r = fakeredis.FakeRedis()
    r.execute_command("FUNCTION", "LOAD", "REPLACE", source)
    (lib,) = r.execute_command(*scripts.list_command())
    registered = {f[b"name"].decode(): sorted(x.decode() for x in f[b"flags"]) for f in lib[b"functions"]}
    assert set(registered) == {f"tq_{n}" for n in scripts.script_names()} | {"tq_version"}
    flagged = {n: sorted(fl) for n, fl in scripts.function_flags().items()}
    assert {n: fl for n, fl in registered.items() if fl} == flagged
    assert r.execute_command("FCALL", "tq_version", 0).decode() == version


# ---------------------------------------------------------------------------------------------
# Declarations: @include lines and headers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_include_lines_sit_at_the_top(f: LuaFile):
    first_code = re.search(r"\S", strip_comments(f.text))
    last_include = max((m.end() for m in scripts.INCLUDE_LINE.finditer(f.text)), default=0)
    assert first_code is None or last_include <= first_code.start(), f"{f.name}: put '-- @include' lines above the code"


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_every_used_helper_is_included(f: LuaFile):
    lib = library_model()
    missing = lib.direct_needs(f) - lib.reachable(f)
    assert not missing, f"{f.name}.lua uses helpers of includes it does not @include: {sorted(missing)}"


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_includes_are_said_where_they_are_used(f: LuaFile):
    """Each file names every include whose helpers it calls itself, and no other."""
    lib = library_model()
    declared = set(declared_includes(f.text))
    needs = lib.direct_needs(f)
    assert needs <= declared, f"{f.name}.lua: add '-- @include' lines for {sorted(needs - declared)}"
    assert declared <= needs, f"{f.name}.lua: it uses nothing of {sorted(declared - needs)}; drop those @include lines"


@pytest.mark.parametrize("f", list(library_model().includes.values()), ids=lambda f: f.name)
def test_helpers_are_defined_before_they_are_used(f: LuaFile):
    """In the one-chunk library a local used above its definition would be a (nil) global."""
    names = list(f.symbols)
    for at, sym in enumerate(names):
        later = {n for n in identifiers(f.symbols[sym]) & set(names[at + 1 :]) if f.symbols[n] != f.symbols[sym]}
        assert not later, f"{f.name}.lua: {sym} uses {sorted(later)}, defined below it"


@pytest.mark.parametrize("f", list(library_model().includes.values()), ids=lambda f: f.name)
def test_include_header_says_what_it_offers(f: LuaFile):
    offers = section(header(f.text), "Offers")
    assert offers is not None, f"{f.name}.lua: its header needs an 'Offers:' section"
    words = set(re.findall(r"\b\w+\b", offers))
    assert set(f.symbols) <= words, f"{f.name}.lua: Offers misses {sorted(set(f.symbols) - words)}"
    called = set(re.findall(r"\b(\w+)\(", offers))
    assert called <= set(f.symbols), f"{f.name}.lua: Offers lists {sorted(called - set(f.symbols))}, not defined here"


@pytest.mark.parametrize("f", list(library_model().scripts.values()), ids=lambda f: f.name)
def test_script_is_one_function_with_a_contract(f: LuaFile):
    assert list(f.symbols) == [f.name], f"{f.name}.lua must define only 'local function {f.name}(KEYS, ARGV)'"
    assert re.search(rf"^local function {f.name}\(KEYS, ARGV\)", f.code, re.MULTILINE)
    head = header(f.text)
    for name in ("Input", "Output", "Touches"):
        assert section(head, name) is not None, f"{f.name}.lua: its header needs an '{name}:' section"


# ---------------------------------------------------------------------------------------------
# Touches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_every_key_is_built_from_a_literal(f: LuaFile):
    _, unknown = prefix_keys(f.code)
    assert not unknown, f"{f.name}.lua: write the key kind as a literal after the prefix: {unknown}"


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_touches_header_lists_exactly_the_keys_touched(f: LuaFile):
    lib = library_model()
    listed = touches_listed(f.text)
    assert listed is not None, f"{f.name}.lua: its header needs a 'Touches:' section"
    touched = lib.touches(f)
    unlisted = {t for t in touched if not any(ns == t[0] and fnmatch.fnmatchcase(t[1], pat) for ns, pat in listed)}
    untouched = {p for p in listed if not any(ns == p[0] and fnmatch.fnmatchcase(k, p[1]) for ns, k in touched)}
    assert not unlisted, f"{f.name}.lua touches {show(unlisted)}, not in its Touches header"
    assert not untouched, f"{f.name}.lua's Touches header lists {show(untouched)}, which it does not touch"


def test_touches_derivation_follows_helpers_and_literals():
    """The analysis itself: a chain with variable parts, KEYS[1] as a key, a helper's keys."""
    assert prefix_keys("local k = prefix .. 'rank:' .. task .. ':' .. opts.dp_rank\n")[0] == {"rank:*:*"}
    assert prefix_keys("x(prefix .. 'alive', prefix .. \"tmp:ready\")")[0] == {"alive", "tmp:ready"}
    assert prefix_keys("emit(prefix, 'insert')")[0] == set()
    assert prefix_keys("doomed[1] = prefix .. kind .. t")[1] == ["prefix .. kind .. t"]
    assert keys_kinds("local prefix = partition_prefix(KEYS[1])\n") == set()
    assert keys_kinds("redis.call('EXISTS', KEYS[1])") == {"meta"}
    lib = library_model()
    assert ("p", "events") in lib.touches(lib.scripts["insert"])  # through emit
    assert ("p", "wake:*") in lib.touches(lib.scripts["insert"])  # emit -> wake_waiters -> wake_one


# ---------------------------------------------------------------------------------------------
# Lua limits of the one-chunk library
# ---------------------------------------------------------------------------------------------


def count_top_level_locals(source: str) -> int:
    return sum(len(names) for _, names in top_level_names(strip_comments(source)))


def test_library_stays_within_luas_local_limit():
    source, _ = scripts.library()
    count = count_top_level_locals(source)
    # 80 at the split into topic includes; room is left for the locals a top-level loop adds.
    assert count <= LUA_MAX_LOCALS - 20, f"{count} top-level locals; Lua allows {LUA_MAX_LOCALS} in the library's chunk"


def test_no_function_uses_too_many_upvalues():
    lib = library_model()
    top = set(lib.defined_in)
    for f in all_files():
        for sym, code in f.symbols.items():
            used = identifiers(code) & top - {sym}
            assert len(used) < LUA_MAX_UPVALUES, f"{sym} uses {len(used)} top-level locals (Lua 5.1 allows 60)"


# ---------------------------------------------------------------------------------------------
# One partition, one hash slot: no script reaches outside its first key's hash tag
# ---------------------------------------------------------------------------------------------
# On a Redis Cluster a function may touch only keys of the slot of the keys it was called with
# (Redis 7 / Valkey refuse anything else: tests/integration/test_cluster.py runs every script on a
# cluster). Here, statically: every key comes from KEYS[1] -- KEYS[1] itself, or the prefix cut
# from it, which keeps its hash tag -- and nothing else can name a key.

PREFIX_SOURCES = {"partition_prefix(KEYS[1])", "channel_prefix(KEYS[1])"}
KEYLESS_COMMANDS = {"TIME"}
KEY_ARGS = {"BITOP": slice(2, None)}  # BITOP op dest src...: every key after the operation; else the first


def redis_calls(code: str) -> list[list[str]]:
    """The argument lists of every ``redis.call(...)`` / ``redis.pcall(...)`` (split at top-level commas)."""
    calls = []
    blank = strip_strings_keep(code)
    for m in re.finditer(r"redis\.p?call\(", blank):
        depth, args, current = 1, [], []
        for at in range(m.end(), len(code)):
            c = blank[at]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth == 0:
                    break
            if c == "," and depth == 1:
                args.append("".join(current).strip())
                current = []
            else:
                current.append(code[at])
        args.append("".join(current).strip())
        calls.append(args)
    return calls


def strip_strings_keep(code: str) -> str:
    """``code`` with string contents blanked but every offset kept (so matches index the original)."""
    return re.sub(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"", lambda m: "'" + " " * (len(m.group()) - 2) + "'", code)


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_only_the_first_key_is_passed_in(f: LuaFile):
    others = sorted(set(re.findall(r"\bKEYS\[(\d+)\]", f.code)) - {"1"})
    assert not others, f"{f.name}.lua uses KEYS[{', '.join(others)}]: derive every key from KEYS[1]'s prefix"


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_the_prefix_is_always_cut_from_the_first_key(f: LuaFile):
    for m in re.finditer(r"(?<![\w.])prefix\s*=(?!=)\s*([^\n]+)", f.code):
        source = m.group(1).strip()
        assert source in PREFIX_SOURCES, (
            f"{f.name}.lua sets prefix = {source}; only {sorted(PREFIX_SOURCES)} keep the hash tag"
        )
    # helpers get the prefix from their caller, never make one; the record wrapper is handed a
    # script's KEYS by its registration (server/library.py), so it cuts the prefix as a script does
    if f.include is not None and f.include != scripts.RECORD_INCLUDE:
        assert not re.search(r"(?<![\w.])prefix\s*=(?!=)", f.code), f"{f.name}.lua assigns a prefix"


@pytest.mark.parametrize("f", all_files(), ids=lambda f: f.name)
def test_no_literal_or_argument_names_a_key(f: LuaFile):
    kinds, _ = prefix_keys(f.code)
    braced = sorted(k for k in kinds if "{" in k or "}" in k)
    assert not braced, f"{f.name}.lua builds keys with a hash tag brace after the prefix: {braced}"
    for args in redis_calls(f.code):
        command = args[0].strip("'\"").upper()
        if command in KEYLESS_COMMANDS or len(args) < 2:
            continue
        for key in args[KEY_ARGS.get(command, slice(1, 2))]:
            assert not key.startswith(("ARGV", "'", '"')), (
                f"{f.name}.lua: redis.call({', '.join(args)}) takes a key from an argument or a literal; "
                f"build it from the prefix"
            )


def _lua_function(name: str) -> str:
    lib = library_model()
    return lib.includes[lib.defined_in[name]].symbols[name]


@pytest.mark.parametrize(
    "helper, keys",
    [
        ("partition_prefix", [("ns", "p"), ("job-7", "step/3.train"), ("a", "x")]),
        ("channel_prefix", [("ns", "rollouts"), ("job-7", "q.1")]),
    ],
)
def test_the_prefix_keeps_the_first_keys_hash_slot(helper: str, keys):
    r = fakeredis.FakeRedis()
    for ns, name in keys:
        k = PartitionKeys(ns, name) if helper == "partition_prefix" else ChannelKeys(ns, name)
        prefix = r.eval(_lua_function(helper) + f"\nreturn {helper}(KEYS[1])", 1, k.meta).decode()
        assert k.meta == prefix + "meta"
        for kind in ("alive", "prod:x", "cons:task", "lease:t", "tag:uid", "q:default", "puts"):
            assert key_slot((prefix + kind).encode()) == key_slot(k.meta.encode()), (prefix, kind)


def test_key_analysis_finds_keys_from_arguments_and_literals():
    assert redis_calls("redis.call('HSET', k, 'a,b)', f(x, y))") == [["'HSET'", "k", "'a,b)'", "f(x, y)"]]
    assert redis_calls("redis.pcall('BITOP', 'OR', prefix .. 'a', ARGV[1])")[0][2:] == ["prefix .. 'a'", "ARGV[1]"]
    bad = load("bad", "local function bad(KEYS, ARGV)\n  return redis.call('GET', ARGV[1])\nend\n")
    with pytest.raises(AssertionError, match="takes a key from an argument"):
        test_no_literal_or_argument_names_a_key(bad)
    with pytest.raises(AssertionError, match="KEYS\\[2\\]"):
        test_only_the_first_key_is_passed_in(load("two", "local x = KEYS[2]\n"))
    with pytest.raises(AssertionError, match="keep the hash tag"):
        test_the_prefix_is_always_cut_from_the_first_key(load("p", "local prefix = ARGV[1] .. ':'\n"))
