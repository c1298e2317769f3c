export FLASHGEMM_CACHE_DIR=/tmp/fg6
python scripts/ab_revision.py --rounds 4 --dtype bf16 fp8 --dist uniform skewed --set split_last_round=1 --shape 8,4096,200,7168,2048 --shape 8,4096,200,4096,7168 --shape 16,2048,180,3072,4096 --shape 32,1024,240,4096,7168 2>&1 | grep "^| "
