"""The documentation's reference cannot drift from the code.

Every public name has a ::: directive in docs/reference (mkdocstrings renders it from the
docstring; tests/unit/test_docs_build.py builds the site), the environment-variable table is
checked against the names the code reads, and every Python example in the docs carries a marker
saying how tests/integration/test_docs_examples.py runs it.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.docs_examples import ROOT, examples


def _reference_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))


@pytest.mark.timeout(30)
def test_every_public_name_has_a_place_in_the_reference() -> None:
    import aiocoll

    text = _reference_text()
    # aiocoll's names load lazily from private modules: each needs its own ::: directive, by its
    # public name (the reference never shows the private module it is defined in)
    for name in aiocoll.__all__:
        if name == "__version__":
            continue
        assert re.search(rf"^::: aiocoll\.{name}$", text, re.M), (
            f"aiocoll.{name} is not in docs/reference (add '::: aiocoll.{name}')"
        )
    assert not re.search(r"^::: .*\._", text, re.M), "a ::: directive names a private module or name"
    # the other public modules are rendered whole, from their __all__
    for module in ("aiocoll.sync", "aiocoll.torch", "aiocoll.ft", "aiocoll.ft_torch"):
        assert re.search(rf"^::: {re.escape(module)}$", text, re.M), f"{module} is not in docs/reference"


def _variables_the_code_reads() -> set[str]:
    names: set[str] = set()
    for folder in ("aiocoll", "server", "client"):
        for path in (ROOT / folder).rglob("*.py"):
            if "testing" in path.parts:
                continue
            names |= set(re.findall(r"\bAIOCOLL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


@pytest.mark.timeout(30)
def test_the_environment_page_lists_every_variable_the_code_reads() -> None:
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    listed = set(re.findall(r"^\| `(AIOCOLL_[A-Z0-9_]+)`", page, re.M))
    read = _variables_the_code_reads()
    assert not read - listed, (
        f"read by the code but not in docs/reference/environment.md: {sorted(read - listed)}"
    )
    assert not listed - read, f"in docs/reference/environment.md but read nowhere: {sorted(listed - read)}"


@pytest.mark.timeout(30)
def test_every_python_example_says_how_it_runs_and_compiles() -> None:
    found = examples()
    assert found, "no ```python blocks found in the docs"
    unmarked = [e.label for e in found if e.mode == "unmarked"]
    assert not unmarked, (
        "these ```python blocks have no '<!-- example: ... -->' marker on the line before "
        f"(see tests/docs_examples.py): {unmarked}"
    )
    for example in found:
        try:
            compile(example.code, example.label, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            pytest.fail(f"{example.label}: {exc}")


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
def test_headings_get_githubs_anchors() -> None:
    slug = _hooks().github_slug
    assert slug("Elastic jobs: --nnodes MIN:MAX") == "elastic-jobs---nnodes-minmax"
    assert slug("The web page") == "the-web-page"
    assert slug("aiocoll coordinator") == "aiocoll-coordinator"


@pytest.mark.timeout(30)
def test_links_to_repository_files_become_paths_and_others_stay() -> None:
    rewrite = _hooks().repository_links_as_paths
    docs = ROOT / "docs"
    page = "guides/example.md"
    text = "[the demo](../../examples/demo.py) and [examples/demo.py](../../examples/demo.py)"
    assert rewrite(text, page, docs) == "the demo (`examples/demo.py`) and `examples/demo.py`"
    kept = "[Security](security.md), [a page](../PERFORMANCE.md#gpus), [web](https://example.org/x)"
    assert rewrite(kept, page, docs) == kept
    missing = "[gone](../../examples/no_such_file.py)"
    assert rewrite(missing, page, docs) == missing  # left for the strict build to report
