"""One source for every number: each figure quoted in the prose is what its result file
gives, nothing performance-like is typed by hand, and the check notices when a result
file changes."""
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numba_sc
from numba_sc.tools import prose, results
from numba_sc.tools.prose import check_prose, prose_files, render_table, update_prose
from numba_sc.tools.results import evaluate, load

LINK = '[{text}](benchmarks/results/net_scans.json "ratio(run(r, net=\'resnet21\', cloud=\'kitti\', dtype=\'float32\'))")'


def _value():
    return evaluate("ratio(run(r, net='resnet21', cloud='kitti', dtype='float32'))", load("net_scans"))[0]


def test_prose_figures_are_the_recorded_ones():
    findings = check_prose()
    assert not findings, f"{len(findings)} figures in the prose disagree with benchmarks/results/:\n" + \
        "\n".join(map(str, findings[:40]))


def test_the_prose_quotes_figures():
    # Guards the test above: prose with no figure link at all would pass it vacuously.
    links = [m for p in prose_files() for _, text in prose._texts(p) for m, _ in prose._figures(text)]
    assert len(links) >= 20, f"only {len(links)} figure links in the prose"


def test_a_changed_result_file_is_noticed(tmp_path):
    """Scale every fractional number of each result file the prose quotes by its own
    random factor: the figure links into those files whose figures are not whole
    numbers (counts) must now be reported stale, and so must every table."""
    copy = tmp_path / "results"
    shutil.copytree(results.results_folder(), copy)
    rng = random.Random(0)

    def shake(node):
        if isinstance(node, dict):
            return {k: shake(v) for k, v in node.items()}
        if isinstance(node, list):
            return [shake(v) for v in node]
        if isinstance(node, float):
            return node * rng.uniform(1.2, 1.8)
        return node

    texts = [t for p in prose_files() for _, t in prose._texts(p)]
    links = [(m, shown) for t in texts for m, shown in prose._figures(t)]
    quoted = {m.group(3) for m, _ in links} | {m.group(1) for t in texts for m in prose.TABLE.finditer(t)}
    assert quoted
    for name in quoted:
        path = copy / name
        path.write_text(json.dumps(shake(json.loads(path.read_text()))))
    # measured: a figure that a changed measurement changes (counts, and byte sizes, which
    # the files hold as integers, stay as they were)
    measured = [(m, shown) for m, shown in links
                if evaluate(m.group(4), load(m.group(3))) != evaluate(m.group(4), load(m.group(3), copy))]
    noticed = [m for m, shown in measured if prose._check_link(m, shown, copy)]
    assert len(noticed) >= 0.95 * len(measured), f"only {len(noticed)} of {len(measured)} figure links noticed"
    tables = sum(1 for t in texts for _ in prose.TABLE.finditer(t))
    stale_tables = [f for f in check_prose(results_dir=copy) if f.problem.startswith("stale table")]
    assert len(stale_tables) == tables, f"{len(stale_tables)} of {tables} tables noticed the change"


def test_a_figure_link_is_checked(tmp_path):
    v = _value()
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("ResNet21 takes " + LINK.format(text=f"{v:.2f}x") + " of spconv's time.\n")
    bad.write_text("ResNet21 takes " + LINK.format(text=f"{v + 0.02:.2f}x") + " of spconv's time.\n")
    assert check_prose([good]) == []
    [finding] = check_prose([bad])
    assert "stale" in finding.problem and f"{v + 0.02:.2f}" in finding.problem


def test_typed_figures_are_found(tmp_path):
    md = tmp_path / "typed.md"
    md.write_text("It runs 2.6x faster, in 12 ms, at 3 TB/s.\n"
                  "A 3x3x3 kernel; `0.5x` in code is fine.\n"
                  "\nNapkin: about 4x fewer bytes. <!-- typed: napkin math, not a measurement -->\n")
    found = [f.text for f in check_prose([md])]
    assert found == ["2.6x", "12 ms", "3 TB/s"]


def test_a_range_and_a_wrong_count(tmp_path):
    r = load("net_scans")
    lo, hi = evaluate("span(ratio(x) for x in rows(r['runs'], net='resnet21'))", r)
    expr = "span([ratio(x) for x in rows(r['runs'], net='resnet21')])"
    md = tmp_path / "range.md"
    md.write_text(f'[{lo:.2f}-{hi:.2f}x](benchmarks/results/net_scans.json "{expr}") and '
                  f'[{lo:.2f}x](benchmarks/results/net_scans.json "{expr}")\n')
    [finding] = check_prose([md])
    assert "shows 1 numbers" in finding.problem


def test_update_keeps_the_rounding(tmp_path):
    v = _value()
    md = tmp_path / "stale.md"
    md.write_text("It takes " + LINK.format(text="9.999x") + ".\n")
    [change] = update_prose([md])
    assert f"{v:.3f}x" in md.read_text() and check_prose([md]) == []


def test_a_failing_expression_is_a_finding(tmp_path):
    md = tmp_path / "broken.md"
    md.write_text('[1.0x](benchmarks/results/net_scans.json "ratio(run(r, net=\'nonesuch\'))")\n')
    [finding] = check_prose([md])
    assert "fails: LookupError" in finding.problem


def test_a_table_is_made_again(tmp_path):
    made = render_table("net_scans.json", "network_table(r)")
    assert "| ResNet21 | SemanticKITTI (94,444) | fp32 |" in made
    md = tmp_path / "table.md"
    md.write_text(f"Networks:\n\n<!-- table: net_scans.json network_table(r) -->\n{made}\n<!-- /table -->\n")
    assert check_prose([md]) == []
    md.write_text(md.read_text().replace("**0.61x**", "**0.60x**"))  # one cell typed over
    [finding] = check_prose([md])
    assert finding.problem.startswith("stale table")
    [change] = update_prose([md])
    assert check_prose([md]) == [] and "**0.61x**" in md.read_text()


def test_figures_inside_a_table_block_are_not_typed(tmp_path):
    md = tmp_path / "t.md"
    md.write_text("<!-- table: conv.json conv_table(r) -->\n" + render_table("conv.json", "conv_table(r)")
                  + "\n<!-- /table -->\n")
    assert check_prose([md]) == []


def test_scientific_notation_is_read_as_one_number(tmp_path):
    assert prose._matches("6.0e-05", 6.04e-5) and not prose._matches("6.0e-05", 6.2e-5)
    md = tmp_path / "sci.md"
    v = evaluate("r['runs'][0]['rel_err']['Native']", load("net_scans"))[0]
    md.write_text(f'[{v:.1e}](benchmarks/results/net_scans.json "r[\'runs\'][0][\'rel_err\'][\'Native\']")\n')
    assert check_prose([md]) == []
    md.write_text(md.read_text().replace(f"{v:.1e}", f"{v * 1.5:.1e}"))
    [finding] = check_prose([md])
    assert "stale" in finding.problem


def test_figures_and_book_from_an_installed_package(tmp_path):
    """An installed wheel holds the package alone (no README, results, notebooks beside
    it): there ``numba-sc figures`` and ``numba-sc book`` exit 2 with a one-line reason,
    run as a reader runs them, from another folder, on a copy of the package."""
    site = tmp_path / "site-packages"
    shutil.copytree(Path(numba_sc.__file__).parent, site / "numba_sc", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_SC_RESULTS"}
    env["PYTHONPATH"] = str(site)
    for argv, says in ((["figures"], "no numba-sc checkout here"), (["book", "--out", "b"], "no notebooks in")):
        run = subprocess.run([sys.executable, "-m", "numba_sc", *argv], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 2, (argv, run.stdout, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1 and says in run.stderr, run.stderr
        assert str(site) in run.stderr  # it names where it looked: the installed package's folder
        assert "every quoted figure" not in run.stdout
    assert not (tmp_path / "b").exists()
