"""The documentation agrees with the code and stays inside the repository.

* ``docs/env.md``'s table lists exactly the environment variables of the registry the
  extension exposes (``env_registry()``, declared in ``src/core/env.cc``), each with its
  registered default.
* No tracked text file refers to places outside the repository.
* Every relative link in ``README.md``, ``docs/*.md`` and ``bench/README.md`` points to a
  file of the repository, and an ``#anchor`` in it to a heading of that file.
* ``docs/api.md`` names every public function, class and method of ``mooncake.pg`` and
  ``mooncake.mooncake_ep_buffer``.
* The README opens with the two commands, ``make demo`` and ``make test``, and both are
  Makefile targets.

CPU only, one process, a few seconds (most of it importing torch for the registry).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

ENV_DOC = REPO / "docs" / "env.md"
ENV_HEADER = ["variable", "default", "meaning"]

# Strings that point outside the repository: the notes and the machine of the people who
# wrote it. Built from parts so that no other file needs to spell them to test for them.
OUTSIDE = ["../" + "shared", "/" + "work" + "/", "DESIGN" + ".md", "STYLE" + ".md"]

LINKED_DOCS = [
    "README.md",
    "bench/README.md",
    *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
]


# --- markdown helpers ------------------------------------------------------------------------


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def table_cells(line: str) -> list[str]:
    """The cells of a Markdown table row (an escaped ``\\|`` stays inside its cell)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def github_slug(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` ... for repeats."""
    text = heading.strip().lower()
    slug = "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    return slug if n == 0 else f"{slug}-{n}"


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            found.add(github_slug(m.group(1), seen))
    return found


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link outside code."""
    out = []
    for n, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        out.extend((n, m.group(1)) for m in LINK.finditer(line))
    return out


# --- environment variables -------------------------------------------------------------------


def env_table() -> dict[str, str]:
    """``{variable: default}`` from the one table of docs/env.md whose header is
    ``| variable | default | meaning |``. A default is written in backticks; an empty
    default as a cell starting with ``empty``."""
    lines = ENV_DOC.read_text(encoding="utf-8").splitlines()
    starts = [
        i
        for i, line in enumerate(lines)
        if line.startswith("|") and table_cells(line) == ENV_HEADER
    ]
    assert len(starts) == 1, (
        f"docs/env.md must have exactly one '| variable | default | meaning |' table, found {len(starts)}"
    )
    i = starts[0] + 2  # past the header and the separator row
    assert set(lines[i - 1].replace("|", "").replace(" ", "")) <= set("-:"), (
        "no separator row after the header"
    )
    table: dict[str, str] = {}
    while i < len(lines) and lines[i].startswith("|"):
        cells = table_cells(lines[i])
        assert len(cells) == 3, f"docs/env.md line {i + 1}: expected 3 cells, got {cells}"
        name_cell, default_cell, meaning = cells
        m = re.fullmatch(r"`(MOONCAKE_[A-Z0-9_]+)`", name_cell)
        assert m, f"docs/env.md line {i + 1}: variable cell {name_cell!r} is not `MOONCAKE_...`"
        name = m.group(1)
        assert name not in table, f"docs/env.md lists {name} twice"
        d = re.fullmatch(r"`([^`]*)`", default_cell)
        if d:
            table[name] = d.group(1)
        else:
            assert default_cell.startswith("empty"), (
                f"docs/env.md line {i + 1}: default of {name} must be `value` or start with 'empty'"
            )
            table[name] = ""
        assert meaning, f"docs/env.md line {i + 1}: {name} has no meaning"
        i += 1
    return table


@pytest.fixture(scope="module")
def registry() -> dict[str, str]:
    from mooncake import pg

    rows = pg._ext.env_registry()
    assert rows, "the extension's env_registry() is empty"
    return {name: default for name, default, _ in rows}


def test_env_table_lists_every_registered_variable_with_its_default(registry):
    table = env_table()
    missing = sorted(set(registry) - set(table))
    assert not missing, f"registered in src/core/env.cc but not in docs/env.md: {missing}"
    wrong = {n: (table[n], registry[n]) for n in registry if table[n] != registry[n]}
    assert not wrong, f"docs/env.md defaults differ from the registry (doc, registry): {wrong}"


def test_env_table_names_no_unregistered_variable(registry):
    extra = sorted(set(env_table()) - set(registry))
    assert not extra, f"docs/env.md lists variables the registry does not declare: {extra}"


# --- nothing refers outside the repository ---------------------------------------------------


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked files are unknown")
    files = [REPO / p for p in out.decode().split("\0") if p]
    assert files, "git ls-files listed nothing"
    return files


def test_no_tracked_file_refers_outside_the_repository():
    hits = []
    for path in tracked_files():
        if path.resolve() == THIS or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            hits.extend(f"{path.relative_to(REPO)}:{n}: {s}" for s in OUTSIDE if s in line)
    assert not hits, "references to places outside the repository:\n" + "\n".join(hits)


# --- links -----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", LINKED_DOCS)
def test_relative_links_point_to_files_and_headings_that_exist(doc):
    path = REPO / doc
    assert path.is_file(), f"{doc} is missing"
    problems = []
    for n, target in links(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not dest.is_relative_to(REPO):
            problems.append(f"{doc}:{n}: {target} leaves the repository")
        elif not dest.exists():
            problems.append(f"{doc}:{n}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{doc}:{n}: {target}: no heading with anchor #{anchor}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checks_see_links_and_anchors():
    """The helpers above find what they must, so the link test cannot pass vacuously."""
    text = "# A `b.c` (d)\n```\n[x](nope.md)\n# not a heading\n```\nsee [y](docs/api.md#e) and `[z](q.md)`\n"
    assert links(text) == [(6, "docs/api.md#e")]
    seen: dict[str, int] = {}
    assert github_slug("A `b.c` (d)", seen) == "a-bc-d"
    assert github_slug("A `b.c` (d)", seen) == "a-bc-d-1"
    assert "readme" not in anchors(REPO / "README.md")
    assert "performance" in anchors(REPO / "README.md")
    assert links((REPO / "README.md").read_text(encoding="utf-8")), "README.md has no links"


# --- the API reference covers the public API -------------------------------------------------


def public_api() -> list[str]:
    from mooncake import errors, fp8, pg
    from mooncake import mooncake_elastic_buffer as ht
    from mooncake import mooncake_ep_buffer as ep

    names = list(pg.__all__) + list(ep.__all__) + list(errors.__all__) + list(ht.__all__)
    names += [n for n in dir(ep.Buffer) if not n.startswith("_")]  # the elastic mixin's too
    names += [n for n in dir(ht.ElasticBuffer) if not n.startswith("_")]
    names += [n for n in dir(ht.EPHandle) if not n.startswith("_")]
    names += [n for n in ep.DispatchHandle._fields if n != "state"]
    names += ["current_stream_wait", "MooncakeBackend", "transport_of"]
    names += [n for n in ("quantize", "dequantize", "error_bound") if hasattr(fp8, n)]
    return sorted(set(names))


def test_api_reference_names_every_public_function_and_class():
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    code = " ".join(re.findall(r"`[^`]*`", api))
    missing = [n for n in public_api() if not re.search(rf"\b{re.escape(n)}\b", code)]
    assert not missing, f"docs/api.md does not name these public names in code: {missing}"


# --- the README's two commands ---------------------------------------------------------------


def test_readme_opens_with_make_demo_and_make_test():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    assert m and text.index("```bash") < text.index("\n## "), (
        "README.md must open with a bash block"
    )
    commands = [line.split("#")[0].strip() for line in m.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no {target} target"
