# Source this on the lent GPU machine (see ../shared/tools/device/README.md):
#   . benchmarks/gpu_env.sh
# - .device-env/ holds sitecustomize.py (the NumPy 2.5 fix numba needs there);
# - .devdata/ holds copies of the real scans (../shared is not on that machine);
# - .peers/ holds spconv 2.3.8 and its needs (../shared/tools/device/peers.sh); a wheel
#   repacked as NAME.tar.xz (smaller: the carry limit is 64 MiB) is unpacked in place.
export PYTHONPATH=$PWD/.device-env:$PWD NUMBA_SC_DATA=$PWD/.devdata NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1
if [ -d .peers ] && [ ! -d /tmp/peers/spconv ]; then
  mkdir -p /tmp/peers && python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl \
    && for t in .peers/*.tar.xz; do tar -xJf "$t" -C /tmp/peers; done
fi
[ -d /tmp/peers ] && export PYTHONPATH=$PYTHONPATH:/tmp/peers
