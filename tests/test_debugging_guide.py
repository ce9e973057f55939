"""The debugging guide's session really works: pdb stops inside a simulated kernel."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pdb_stops_inside_a_simulated_kernel():
    commands = "p cuda.threadIdx.x, cuda.blockIdx.x\np tile\np x._item[:4]\nc\n"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONBREAKPOINT="pdb.set_trace")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "debug_kernel.py")], input=commands,
                         capture_output=True, text=True, env=env, timeout=120)
    out = run.stdout
    assert run.returncode == 0, run.stderr
    assert "(0, 1)" in out  # stopped in thread 0 of block 1
    assert "8.,  9., 10., 11., 12., 13., 14., 15." in out  # that block's shared memory
    assert "array([0., 1., 2., 3.]" in out
    assert "block sums: [28. 92.]" in out


def _documented_break_session():
    """Section 3's session: the command after ``$``, the pdb commands after ``(Pdb)``, and
    the other lines, what the session prints (``...`` stands for anything)."""
    text = (ROOT / "docs" / "debugging.md").read_text()
    section = text[text.index("## 3. Stop in a library kernel"):text.index("## 4.")]
    block = section[section.index("```text\n") + len("```text\n"):]
    lines = block[:block.index("```")].splitlines()
    command = [line[2:] for line in lines if line.startswith("$ ")]
    typed = [line[len("(Pdb) "):] for line in lines if line.startswith("(Pdb) ")]
    shown = [line for line in lines if not line.startswith(("$ ", "(Pdb) ")) and line.strip() != "..."]
    return command, typed, shown


def test_the_documented_break_command_stops_in_the_kernel():
    """docs/debugging.md, section 3, as written: the `numba-sc ladder ... --break` command
    run with the session's pdb commands on standard input prints every line the session
    shows, in order (`...` in a line matches anything: a path, a line number)."""
    import re

    from conftest import load_scan

    load_scan("semantickitti")  # the command reads the scan
    command, typed, shown = _documented_break_session()
    assert len(command) == 1 and command[0].startswith("numba-sc ladder ") and "--break" in command[0]
    assert typed[-1] == "c" and shown  # it continues to the end, and shows something to check
    args = command[0].split()[1:]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "numba_sc", *args], input="\n".join(typed) + "\n",
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # pdb's prompt and what a command prints share a line: split them apart
    printed = [piece for line in run.stdout.splitlines() for piece in line.split("(Pdb) ") if piece]
    at = 0
    for want in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + "$")
        while at < len(printed) and not pattern.match(printed[at]):
            at += 1
        assert at < len(printed), f"the documented line {want!r} is not in the output (in order):\n{run.stdout}"
        at += 1
