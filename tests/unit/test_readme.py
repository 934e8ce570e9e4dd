"""The README's fresh-machine commands stay true: CI runs the README's test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fresh_machine_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block, "README must open with a bash block holding the two fresh-machine commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_a_demo_command_and_a_test_command() -> None:
    demo, test = _fresh_machine_commands()
    assert "aiocoll run" in demo and "examples/" in demo
    assert "pytest" in test and "requirements-test.txt" in test


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, test = _fresh_machine_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test.strip() in ci_lines


def test_demo_script_named_by_the_readme_exists() -> None:
    demo, _ = _fresh_machine_commands()
    script = re.search(r"(examples/\S+\.py)", demo)
    assert script and (ROOT / script.group(1)).is_file()


def test_the_container_example_publishes_every_port_the_readme_then_opens() -> None:
    readme = (ROOT / "README.md").read_text()
    runs = re.findall(r"`(docker run [^`]*)`", readme)
    assert runs, "the README shows how to run the coordinator's image"
    published = {int(p) for run in runs for p in re.findall(r"-p (\d+):\d+", run)}
    opened = {int(p) for p in re.findall(r"http://HOST:(\d+)", readme)}
    assert opened and opened <= published, f"the README opens {opened}; its docker run publishes {published}"
