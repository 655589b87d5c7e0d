#!/bin/bash
# Issue 30, item 3, on a lent GPU: the embedded SmolLM2's drafters trained on ~10x the committed corpus.
# The device has no network, so the model travels too: its GGUF (98 MB, the source of the fp32 target)
# in three parts, each under a call's 64 MiB carry (the working tree ~16 MiB, the wheels ~24 MiB):
#   here:    bash scripts/gpu/train_round.sh bundle      # .round/gguf-{1,2,3}.part + gguf.sha256
#            (add /.round/ to .git/info/exclude)
#   device:  carry [".whl", ".gpu", ".round/gguf-1.part", ".round/gguf.sha256"]: source .gpu/setup.sh
#            carry [".round/gguf-2.part"]: ls .round        (ignored paths already there stay, while warm)
#            carry [".round/gguf-3.part"]: source .gpu/setup.sh; bash scripts/gpu/train_round.sh mtp
# Parts, one device call each (inside the 10-minute call limit):
#   mtp      the corpus: the target's answers to every training prompt (3,740: prompts_train, _train2, _broad;
#            never prompts_eval), a greedy pass then sampled ones (T = 0.8) until CORPUS_S seconds are spent;
#            then the MTP head trained on it (hidden states kept by make_corpus: no second pass).
#            Back in $OUT: summary.log, logs.tgz, mtp.safetensors + mtp.json, corpus.npz (token ids only).
#   drafters (carry .round/corpus.npz, what part mtp returned) EAGLE-3 and DFlash trained on that corpus.
#            Back in $OUT: summary.log, logs.tgz, eagle3.tgz.part-* and dflash.tgz.part-* (cat them | tar xz).
# Then on the CPU: python -m mlx_engine.train.heldout_acceptance against the shipped head (README of
# mlx_engine/heads/smollm2-135m-instruct), and the chat bench with the best.
# Knobs (environment): SCALE multiplies every time budget, LIMIT answers only the first N prompts, BATCH
# rows per generation batch, CORPUS_S seconds of generation (180), MTP_STEPS / E3_STEPS / DF_STEPS, DF_BATCH. A dry
# run on the CPU, to see it work:
#   OUT=/tmp/round-out SCALE=0.2 LIMIT=32 BATCH=16 MTP_STEPS=20 bash scripts/gpu/train_round.sh mtp
set -u
PART=${1:?usage: train_round.sh bundle|mtp|drafters}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$PART" = bundle ]; then  # here, not on the device
  src=$(python -c "from mlx_engine.models.default import default_gguf; print(default_gguf())") || exit 2
  mkdir -p .round && rm -f .round/gguf-*.part
  head -c 20M "$src" > .round/gguf-1.part
  tail -c +$(( 20 * 1048576 + 1 )) "$src" | split -b 40M -a 1 --numeric-suffixes=2 --additional-suffix=.part - .round/gguf-
  (cd "$(dirname "$src")" && sha256sum $GGUF) > .round/gguf.sha256
  ls -la .round; exit 0
fi
source "$(dirname "$0")/lib.sh"  # step NAME LIMIT CMD...
export MLX_ENGINE_CACHE=${MLX_ENGINE_CACHE:-/tmp/mlx-engine-cache}  # where the default model is built
if [ ! -f $MLX_ENGINE_CACHE/$GGUF ] && [ -f .round/gguf.sha256 ]; then  # the carried parts, once
  mkdir -p $MLX_ENGINE_CACHE && cat .round/gguf-*.part > $MLX_ENGINE_CACHE/$GGUF
  (cd $MLX_ENGINE_CACHE && sha256sum -c "$OLDPWD/.round/gguf.sha256") || { rm -f $MLX_ENGINE_CACHE/$GGUF; exit 2; }
fi
SCALE=${SCALE:-1}; BATCH=${BATCH:-384}; LIMIT=${LIMIT:-0}
R=${ROUND_DIR:-/tmp/round}  # the machine's own disk: the corpus with its hidden states (GiBs) stays there
mkdir -p "$R" "$OUT"
mins() { python3 -c "print(round($1 * $SCALE, 3))"; }
PY="python3"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a $OUT/summary.log
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>&1 | tee -a $OUT/summary.log

# the fp32 folder, converted once from the GGUF (outside every time budget below)
TAILN=2 step model 200 $PY -c "from mlx_engine.models.default import default_model_path; print(default_model_path())"

pack_logs() { (cd $OUT && logs=$(ls *.log | grep -v '^summary.log$') && tar czf logs.tgz $logs && rm $logs); }

if [ "$PART" = mtp ]; then
  $PY scripts/gpu/train_round.py prompts --out $R/prompts.jsonl | tee -a $OUT/summary.log
  # passes over every prompt until the corpus budget is spent: greedy first, then sampled (T = 0.8, a seed
  # each); each pass stops after the batch that crosses what is left (~10 passes: >= 10x the committed
  # 391k answer tokens, if the GPU answers ~20k tokens/s)
  budget=$(python3 -c "print(int(${CORPUS_S:-180} * $SCALE))"); t0=$(date +%s); pass=0
  while :; do left=$(( budget - ($(date +%s) - t0) )); [ $left -ge 10 ] || break
    temp=0.8; [ $pass -eq 0 ] && temp=0
    TAILN=2 step corpus_$pass $(( left + 60 )) $PY -m mlx_engine.train.make_corpus --prompts $R/prompts.jsonl \
      --out $R/corpus_$pass.safetensors --batch $BATCH --max-tokens 160 --minutes $(python3 -c "print($left / 60)") \
      --temp $temp --seed $(( 100 + pass )) --limit $LIMIT
    pass=$(( pass + 1 )); done
  TAILN=3 step pack 60 $PY scripts/gpu/train_round.py pack $R/corpus_*.jsonl --out $OUT/corpus.npz
  TAILN=12 step mtp 270 $PY -m mlx_engine train-mtp --out $R/mtp --corpus $R/corpus_*.safetensors \
    --steps ${MTP_STEPS:-8000} --minutes $(mins 3.2) --fit-minutes --batch 64 --seq-len 64 --lr 1e-3 --warmup 100 \
    --vocab-subset 8192 --init random --log-every 100 --ckpt-every 100000
  cp $R/mtp/mtp.safetensors $R/mtp/mtp.json $OUT/ 2>/dev/null
elif [ "$PART" = drafters ]; then
  CORPUS=${CORPUS:-.round/corpus.npz}
  files=$($PY scripts/gpu/train_round.py unpack $CORPUS --out $R/jsonl) || exit 2
  echo "corpus: $files" | tee -a $OUT/summary.log
  TAILN=12 step eagle3 270 $PY -m mlx_engine train-eagle3 --out $R/eagle3 --corpus $files \
    --steps ${E3_STEPS:-8000} --minutes $(mins 3.6) --fit-minutes --batch 64 --seq-len 64 --lr 1e-3 --warmup 100 \
    --vocab-subset 8192 --encode-batch 64 --log-every 100 --ckpt-every 100000
  TAILN=12 step dflash 230 $PY -m mlx_engine train-dflash --out $R/dflash --corpus ${files// /,} \
    --steps ${DF_STEPS:-3000} --minutes $(mins 3.2) --batch ${DF_BATCH:-32}
  # the weights and configs only (not the features or checkpoints), in parts under $OUT's 16 MiB a file
  for d in eagle3 dflash; do [ -f $R/$d/model.safetensors ] || continue
    (cd $R && tar czf - $d/config.json $d/model.safetensors $(ls $d/*.json | grep -v config.json)) \
      | split -b 15m - $OUT/$d.tgz.part-; done
else
  echo "usage: train_round.sh bundle|mtp|drafters" >&2; exit 2
fi
pack_logs
ls -la $OUT | tee -a $OUT/summary.log
