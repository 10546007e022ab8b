"""Seeded GGUF fuzzing in the suite (tests/gguf_fuzz.py has the mutants and a larger run): two hundred mutants
of the committed pairs, each loaded and run in a worker subprocess, must end in 'ok' or one of pydflash's typed
errors: never a signal, a hang or another exception. PYDFLASH_FUZZ_FIRST_SEED picks other mutants."""

from __future__ import annotations

import os

import gguf_fuzz

N_MUTANTS = 200  # (300 before: the suite's time; tests/gguf_fuzz.py runs more)


def test_mutated_ggufs_fail_with_typed_errors(tmp_path):
    first = int(os.environ.get("PYDFLASH_FUZZ_FIRST_SEED", "0"))
    outcomes: dict[str, int] = {}

    def count(i, seed, what, outcome):
        outcomes[outcome.split(" ")[0]] = outcomes.get(outcome.split(" ")[0], 0) + 1

    failures = gguf_fuzz.fuzz(range(first, first + N_MUTANTS), tmp_path, count)
    print(f"seeds {first}..{first + N_MUTANTS - 1}: {outcomes}")
    assert not failures, "\n".join(f"seed {seed}: {outcome} after {what} (replay: python tests/gguf_fuzz.py "
                                   f"--replay {seed})" for seed, what, outcome in failures)
    # the mutants reach every stage: files that load and run, and each kind of typed error
    assert {"ok", "ModelLoadError", "GGUFFormatError", "UnsupportedModelError"} <= set(outcomes)
