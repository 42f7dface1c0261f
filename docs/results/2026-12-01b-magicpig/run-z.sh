set -u
T0=$(date +%s)
(cd .gpu && nvcc -O3 -arch=sm_90 -std=c++17 -o zc-probe6 zc-probe6.cu 2>/dev/null) && timeout 200 .gpu/zc-probe6 > $OUT/zc-probe6.txt 2>&1; echo "probe rc=$? $(( $(date +%s)-T0 ))s"; cat $OUT/zc-probe6.txt
