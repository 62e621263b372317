// A stand-in "libnccl.so.2" that is too old (2.12.12) and lacks most symbols, for the loader's
// "too old" message (tests/cuda_build.sh, section 3b).
extern "C" int ncclGetVersion(int* v) {
  *v = 21212;
  return 0;
}
