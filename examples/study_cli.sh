#!/usr/bin/env bash
# The study from the command line: the default (Gemma 3 270M, packaged corpus, trained +
# random-init + zero baselines), then the same with the first key (attention sink) excluded,
# then your own model and corpus.
set -euo pipefail
OUT=${1:-study_out}
equivariance-probe run --out "$OUT/default"
equivariance-probe run --out "$OUT/no_sink" --exclude-keys 0
# equivariance-probe run --out "$OUT/mine" --model /path/to/hf_model_folder --corpus /path/to/texts/ --context-length 512
