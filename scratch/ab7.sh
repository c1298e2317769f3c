export FLASHGEMM_CACHE_DIR=/tmp/fg6
A="python scripts/ab_revision.py --rounds 4 --dtype bf16 --dist uniform skewed"
M="--set tile_m=128 --set consumer_warpgroups=2 --set tile_n=64 --set n_major=1"
S="--shape 8,4095,128,7168,2048 --shape 8,4094,128,7168,2048 --shape 8,4093,128,7168,2048 --shape 8,4095,128,4096,7168 --shape 8,4094,128,4096,7168 --shape 16,2048,128,3072,4096 --shape 16,2048,128,4096,1536 --shape 8,4096,110,7168,2048 --shape 8,4096,140,7168,2048"
$A $M $S 2>&1 | grep "^| bf16"
