"""The README's library example runs as written, so the front page stays true."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_setup_pins_the_cpu_torch_build():
    text = README.read_text()
    assert "pip install torch==2.13.0 -e '.[dev]'" in text
    assert ".venv/bin/python -m pytest" in text
