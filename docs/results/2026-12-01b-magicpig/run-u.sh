set -u
T0=$(date +%s)
(cd .gpu && nvcc -O3 -arch=sm_90 -std=c++17 -o zc-probe5 zc-probe5.cu) && timeout 200 .gpu/zc-probe5 > $OUT/zc-probe5.txt 2>&1; echo "probe rc=$? $(( $(date +%s)-T0 ))s"; cat $OUT/zc-probe5.txt
