export FLASHGEMM_CACHE_DIR=/tmp/fg6
A="python scripts/ab_revision.py --rounds 4 --dtype bf16 --dist uniform skewed --cases dsv3-ep32-down dsv3-ep32-gate_up"
M="--set tile_m=128 --set consumer_warpgroups=2"
$A $M --set tile_n=128 --set n_major=1 2>&1 | grep "^| bf16"
$A $M --set tile_n=128 --set n_major=1 --set balance_rounds=1 2>&1 | grep "^| bf16"
$A $M --set tile_n=64 --set n_major=1 2>&1 | grep "^| bf16"
