"""The whole study from Python: Gemma 3 270M trained vs its random init vs all-zero weights.

    python examples/study.py --out study_out --docs 8 --context-length 512

The same as `equivariance-probe run --out study_out --n-docs 8 --context-length 512`.
"""

from __future__ import annotations

import argparse

from equivariance_probe.display.figures import save_figures, study_figures
from equivariance_probe.runs.study import run_study


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="study_out")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--exclude-first-key", action="store_true", help="leave key position 0 (attention sink) out")
    args = parser.parse_args()

    study = run_study(
        args.model,
        n_docs=args.docs,
        context_length=args.context_length,
        exclude_keys=[0] if args.exclude_first_key else [],
    )
    study.save(args.out)
    save_figures(study_figures(study.trained, study.baselines()), args.out)
    print(study.table())
    print(study.heads())


if __name__ == "__main__":
    main()
