set -uo pipefail
rm -f .gpu/folio; tar -C .gpu -xJf .gpu/walk.tar.xz
FOLIO=.gpu/folio METHODS=magicpig:2% EVAL_SECONDS=300 CHECK_SECONDS=1 bash tools/gpu-smoke.sh needle 1M 2 2>&1 | grep -v "^\s*$" | tail -25
TESTS=0 BUNDLES=walk bash .gpu/ab2.sh 2>&1 | grep -vE "^\s+(norms|rope|K/V|q/k/v|o proj|attention: kernel)"
