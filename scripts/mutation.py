#!/usr/bin/env python3
"""Mutation testing of one core module at a time, with only that module's tests (mutmut 3).

    python scripts/mutation.py MODULE [--max-children 1] [--workdir DIR] [--out FILE]
    python scripts/mutation.py MODULE --sample N [--seed S]    (a seeded random sample of N of its mutants)
    python scripts/mutation.py MODULE --rescore [--workdir DIR]    (the last run, against today's list)
    python scripts/mutation.py MODULE --retest-survivors [--max-children N]   (its survivors, on today's tests)
    python scripts/mutation.py --list

MODULE is a table of `[tool.kvmem.mutation]` in pyproject.toml: the files mutmut mutates (paths inside the
installed package, so kernels/ is kvmem/kernels/), the tests that must kill the mutants and, optionally, `marks`
(a pytest -m expression that selects among those tests: "not mooncake" leaves out the tests that start a Mooncake
master), `deselect` (test ids left out: variants of a slow test that exercise another module's code more than this
one's) and `env` (variables the tests run with); `[tool.mutmut]` holds what every run shares.
scripts/mutation_equivalents.toml lists, per module, the survivors judged equivalent (the mutant, the line mutmut
wrote, and why no test can tell it from the original).

Each run builds a fresh copy of the package laid out as it installs (kvmem/ with kernels/ inside it), the
tests and scripts, with a pyproject.toml whose `[tool.mutmut]` names the module's files and tests, in
`--workdir` (default /tmp/kvmem-mutation/MODULE), runs `mutmut run` there under `nice -n 10`, and prints a
JSON summary: mutants by status, the survivors (name and mutated line), and the score

    score = (killed + timeout + crashed) / (mutants - equivalent - needs_cuda),

where survivors and mutants no test reaches both count as not killed; survivors that only a CUDA device could
kill (listed as such) are left out like the equivalent ones and counted apart (`needs_cuda`), and
`score_of_all_mutants` divides by every mutant. Entries match survivors by function and mutated line, not by
number (mutmut renumbers a function's mutants whenever it changes); an entry that matches no survivor is
reported as `stale_equivalent`. mutmut keeps its results in the work directory: `cd WORKDIR && mutmut show NAME`
prints a mutant's diff.

`--sample N` generates all the module's mutants but tests only N of them, drawn at random with `--seed` (default
0; the draw is over the sorted mutant names, so one seed draws the same mutants from the same code); the run's
names are kept in WORKDIR/sample.json and `--rescore` and `--retest-survivors` score only them. A sample's score
comes with `interval_95` (None for a full run), the Wilson 95% interval of the score of all the module's mutants
that it estimates (binomial: it leaves out the finite-population correction, so it is a little wide).

`--retest-survivors` takes the finished run in the work directory, tests its survivors again on today's code
and tests (a fresh copy in WORKDIR-retest), and scores the run with their new results: a mutant whose mutated
line differs today (its function changed) keeps its old result. The tests written after a long run count
without running it all again.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mutmut depends on toml there
    import toml as tomllib

from kvmem._checks import output_file_arg, positive_int_arg

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = Path(__file__).with_name("mutation_equivalents.toml")
# A mutant whose tests fail, loop past their time or crash the test process is caught.
KILLED = {1: "killed", 3: "killed", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          -11: "crashed", -9: "crashed"}
OTHER = {0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 35: "suspicious", None: "not checked"}


def load_config() -> tuple[dict, dict]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["mutmut"], data["tool"]["kvmem"]["mutation"]


def equivalents(module: str) -> list[dict]:
    return tomllib.loads(EQUIVALENTS.read_text()).get(module, []) if EQUIVALENTS.exists() else []


def build_workdir(workdir: Path, module: dict, shared: dict) -> None:
    """A fresh copy of the package as it installs (kernels/ as kvmem/kernels/), its tests and scripts."""
    if workdir.exists():
        shutil.rmtree(workdir)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "kvmem", workdir / "kvmem", ignore=skip)
    shutil.copytree(ROOT / "kernels", workdir / "kvmem" / "kernels", ignore=skip)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=skip)
    shutil.copytree(ROOT / "scripts", workdir / "scripts", ignore=skip)
    for path in module["mutate"] + module["tests"] + module.get("deselect", []):
        if not (workdir / path.split("::")[0]).exists():
            raise SystemExit(f"mutation.py: {path} (named in pyproject.toml) does not exist")
    selection = module["tests"] + (["-m", module["marks"]] if "marks" in module else [])
    selection += [arg for test in module.get("deselect", []) for arg in ("--deselect", test)]
    settings = {**shared, "only_mutate": module["mutate"], "pytest_add_cli_args_test_selection": selection}
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[tool.pytest.ini_options]", f"markers = {json.dumps(pytest_ini['markers'])}", "", "[tool.mutmut]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    (workdir / "pyproject.toml").write_text("\n".join(lines) + "\n")


def run_mutmut(workdir: Path, env: dict, max_children: int, names: Sequence[str] = ()) -> None:
    """`mutmut run` in `workdir` (only the mutants `names`, if given), logged to workdir/mutmut.log; exits with
    the log's tail when mutmut fails."""
    mutmut = Path(sys.executable).with_name("mutmut")
    if not mutmut.exists():
        raise SystemExit("mutation.py: mutmut is not installed here (pip install -e '.[mutation]')")
    log = workdir / "mutmut.log"
    with open(log, "w") as f:
        proc = subprocess.run(["nice", "-n", "10", str(mutmut), "run", "--max-children", str(max_children), *names],
                              cwd=workdir, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"mutation.py: mutmut failed (exit {proc.returncode}); log in {log}")


def generate_mutants(workdir: Path, env: dict) -> None:
    """mutmut's mutant generation alone (no test runs) in `workdir`: each file's mutants then stand in
    mutants/PATH.meta, untested; a later `mutmut run` there keeps them (their files are newer than the sources)."""
    code = ("import os, mutmut.__main__ as m; m.set_mutant_under_test('mutant_generation'); "
            "os.makedirs('mutants', exist_ok=True); m.copy_src_dir(); m.copy_also_copy_files(); "
            "m.setup_source_paths(); m.store_lines_covered_by_tests(); m.create_mutants(1)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"mutation.py: mutmut could not generate the mutants (exit {proc.returncode})")


def draw_sample(names: Sequence[str], size: int, seed: int) -> list[str]:
    """`size` of the mutants `names` (all of them if fewer), drawn at random with `seed` from the names sorted, so
    that the draw depends only on the seed and the set of names."""
    return sorted(random.Random(seed).sample(sorted(names), min(size, len(names))))


def read_sample(workdir: Path) -> dict | None:
    """The sample a run in `workdir` tested ({"seed", "of", "names"}), None for a run of every mutant."""
    path = workdir / "sample.json"
    return json.loads(path.read_text()) if path.is_file() else None


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> list[float] | None:
    """The Wilson score interval of a proportion (95% at z = 1.96); None without trials."""
    if trials <= 0:
        return None
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def exit_codes(workdir: Path, module: dict) -> dict[str, tuple[str, int | None]]:
    """Each mutant of a run (of its sample, for a sampled run): (the file it mutates, mutmut's exit code; None: not
    tested)."""
    codes = {}
    for path in module["mutate"]:
        meta = json.loads((workdir / "mutants" / (path + ".meta")).read_text())
        codes.update((name, (path, code)) for name, code in meta["exit_code_by_key"].items())
    sample = read_sample(workdir)
    if sample is not None:
        codes = {name: codes[name] for name in sample["names"] if name in codes}
    return codes


def results(workdir: Path, module: dict, codes: dict | None = None) -> dict:
    """Counts the mutants of the module's files by status, and the survivors' mutated lines (`codes`: exit codes
    that replace the run's, for mutants tested again elsewhere)."""
    counts: dict[str, int] = {}
    survivors = []
    for name, (path, code) in sorted(exit_codes(workdir, module).items()):
        code = (codes or {}).get(name, code)
        status = KILLED.get(code) or OTHER.get(code, "suspicious")
        counts[status] = counts.get(status, 0) + 1
        if code not in KILLED:
            survivors.append({"name": name, "status": status, "line": mutated_line(workdir, name, path)})
    return {"counts": counts, "survivors": survivors}


@functools.lru_cache(maxsize=None)
def mutated_line(workdir: Path, name: str, path: str) -> str:
    """The line(s) mutant `name` writes, from mutmut's diff in `workdir` (cached: retesting asks twice)."""
    if str(workdir) not in sys.path:
        sys.path.insert(0, str(workdir))
    os.chdir(workdir)
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(name, path=path)
    return " / ".join(line[1:].strip() for line in diff.splitlines() if line.startswith("+") and
                      not line.startswith("+++"))


def retest_survivors(finished: Path, workdir: Path, module: dict, max_children: int, env: dict) -> dict:
    """Tests again, on today's code and tests in the fresh `workdir`, the mutants that survived the finished run
    in `finished`; returns the exit codes that replace the finished run's: those of the mutants that are still
    the same mutation (same name and mutated line: mutmut renumbers a function's mutants when it changes)."""
    alive = {name: path for name, (path, code) in exit_codes(finished, module).items() if code not in KILLED}
    if not alive:
        return {}
    run_mutmut(workdir, env, max_children, sorted(alive))
    new = exit_codes(workdir, module)
    return {name: new[name][1] for name, path in alive.items()
            if name in new and mutated_line(workdir, name, path) == mutated_line(finished, name, path)}


def function_of(mutant: str) -> str:
    """The mutated function of a mutant's name (`module.x_function__mutmut_12` -> `module.x_function`): mutmut
    numbers a function's mutants in order, so a change elsewhere in the function renumbers them."""
    return mutant.rsplit("__mutmut_", 1)[0]


def score(found: dict, listed: list[dict]) -> dict:
    """Kills over the mutants a test could kill here: the listed survivors (equivalent, or needing CUDA) are left
    out. An entry names a survivor by its function and mutated line, not its number, which shifts whenever the
    function changes; an entry that matches no survivor (its mutant is killed now, or its line is gone) is
    reported as stale."""
    judged = {(function_of(e["mutant"]), e["line"]): e for e in listed}
    left_out: dict[str, list[str]] = {"equivalent": [], "needs CUDA": []}
    alive, matched = [], set()
    for s in found["survivors"]:
        key = (function_of(s["name"]), s["line"])
        e = judged.get(key)
        if e is not None:
            left_out[e.get("kind", "equivalent")].append(s["name"])
            matched.add(key)
        else:
            alive.append(s)
    stale = [e["mutant"] for key, e in judged.items() if key not in matched]
    total = sum(found["counts"].values())
    killed = sum(found["counts"].get(status, 0) for status in set(KILLED.values()))
    counted = total - len(left_out["equivalent"]) - len(left_out["needs CUDA"])
    return {"mutants": total, "killed": killed, "equivalent": len(left_out["equivalent"]),
            "needs_cuda": len(left_out["needs CUDA"]), "not_killed": len(alive),
            "score": round(killed / counted, 4) if counted else None,
            "score_of_all_mutants": round(killed / total, 4) if total else None,
            "stale_equivalent": stale, "survivors": alive}


def check_workdir(workdir: Path, module: dict, args: argparse.Namespace) -> str | None:
    """Why the run cannot go on in `workdir` (None: it can), found before a copy is built or mutmut starts."""
    if args.rescore or args.retest_survivors:
        missing = [path for path in module["mutate"] if not (workdir / "mutants" / (path + ".meta")).is_file()]
        if missing:
            return f"{workdir} holds no finished run of {args.module} (no mutants/{missing[0]}.meta)"
    if args.rescore:
        return None
    built = workdir.with_name(workdir.name + "-retest") if args.retest_survivors else workdir
    if built.exists() and not built.is_dir():
        return f"{built} is not a folder"
    folder = built.parent
    while not folder.exists():
        folder = folder.parent
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        return f"cannot create {built}: {folder} is not a writable folder"
    return None


def main(argv: list[str] | None = None) -> int:
    shared, modules = load_config()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", nargs="?", choices=sorted(modules))
    ap.add_argument("--list", action="store_true", help="list the modules, their files and tests")
    ap.add_argument("--max-children", type=positive_int_arg, default=1,
                    help="mutants tested at once (default 1: the machine is shared)")
    ap.add_argument("--workdir", type=Path, help="where the copy and mutmut's results go "
                    "(default /tmp/kvmem-mutation/MODULE; replaced)")
    ap.add_argument("--out", type=output_file_arg, help="also write the JSON summary here")
    ap.add_argument("--sample", type=positive_int_arg, metavar="N",
                    help="test only N of the module's mutants, drawn at random (the score is then an estimate)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's random seed (default 0)")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--rescore", action="store_true",
                       help="score the finished run in the work directory again against the current list of "
                            "equivalent survivors, without running mutmut")
    again.add_argument("--retest-survivors", action="store_true",
                       help="test the finished run's survivors again on today's code and tests (in WORKDIR-retest) "
                            "and score the run with their new results")
    args = ap.parse_args(argv)
    if args.sample is not None and (args.rescore or args.retest_survivors):
        ap.error("argument --sample: not allowed with --rescore or --retest-survivors (they score the run's sample)")
    if args.list or args.module is None:
        print(json.dumps({name: {key: m[key] for key in ("mutate", "tests", "marks", "deselect") if key in m}
                          for name, m in modules.items()}, indent=1))
        return 0
    module = modules[args.module]
    workdir = (args.workdir or Path("/tmp/kvmem-mutation") / args.module).resolve()
    if (problem := check_workdir(workdir, module, args)) is not None:
        ap.error(f"argument --workdir: {problem}")
    out = Path(args.out).resolve() if args.out else None
    load_before = os.getloadavg()[0]
    seconds, codes = None, None
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **module.get("env", {})}
    if args.retest_survivors:
        retest = workdir.with_name(workdir.name + "-retest")
        build_workdir(retest, module, shared)
        t0 = time.perf_counter()
        codes = retest_survivors(workdir, retest, module, args.max_children, env)
        seconds = round(time.perf_counter() - t0)
    elif not args.rescore:
        build_workdir(workdir, module, shared)
        t0 = time.perf_counter()
        names: list[str] = []
        if args.sample is not None:
            generate_mutants(workdir, env)
            every = exit_codes(workdir, module)
            names = draw_sample(every, args.sample, args.seed)
            (workdir / "sample.json").write_text(json.dumps({"seed": args.seed, "of": len(every), "names": names}))
        run_mutmut(workdir, env, args.max_children, names)
        seconds = round(time.perf_counter() - t0)
    summary = {"module": args.module, "mutate": module["mutate"], "tests": module["tests"],
               "marks": module.get("marks"), "deselected": len(module.get("deselect", [])),
               "statuses": None, **score(found := results(workdir, module, codes), equivalents(args.module)),
               "retested": None if codes is None else len(codes),
               "sample": None if (sample := read_sample(workdir)) is None else
               {"seed": sample["seed"], "tested": len(sample["names"]), "of": sample["of"]},
               "interval_95": None,
               "seconds": seconds, "max_children": args.max_children,
               "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "workdir": str(workdir)}
    summary["statuses"] = found["counts"]
    if sample is not None:  # a full run's score is the module's own, not an estimate
        counted = summary["mutants"] - summary["equivalent"] - summary["needs_cuda"]
        summary["interval_95"] = wilson_interval(summary["killed"], counted)
    text = json.dumps(summary, indent=1, ensure_ascii=False)
    if out:
        out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
