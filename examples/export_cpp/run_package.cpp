// Runs an AOTInductor package that wfpass.export made, from C++ alone: no
// Python in the process. The package calls wfpass's ops by name, so the
// program loads wfpass's two libraries first, the kernels, then the ops'
// definitions (`python -m wfpass libraries` builds them once and prints
// their paths).
//
//   run_package PACKAGE TOKENS.bin T B OUT.bin LIBRARY...
//
// TOKENS.bin: T x B int64 token ids (raw, row-major); OUT.bin: the first
// output as raw float32, its shape on stdout. examples/export_cpp.py
// builds this file with torch's headers and runs it.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s PACKAGE TOKENS.bin T B OUT.bin LIBRARY...\n", argv[0]);
    return 2;
  }
  for (int i = 6; i < argc; ++i) {
    // RTLD_GLOBAL: the kernels' library registers into the dispatcher of
    // the libtorch this program links, as torch.ops.load_library does.
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::fprintf(stderr, "cannot load %s: %s\n", argv[i], dlerror());
      return 1;
    }
  }
  const int64_t T = std::atoll(argv[3]), B = std::atoll(argv[4]);
  std::vector<int64_t> tokens(static_cast<size_t>(T * B));
  std::ifstream in(argv[2], std::ios::binary);
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * sizeof(int64_t)));
  if (!in) {
    std::fprintf(stderr, "%s does not hold %lld x %lld int64 tokens\n", argv[2], (long long)T, (long long)B);
    return 1;
  }
  at::Tensor x = at::from_blob(tokens.data(), {T, B}, at::kLong).clone();
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  std::vector<at::Tensor> out = loader.run({x});
  at::Tensor y = out.at(0).contiguous().to(at::kFloat);
  std::ofstream f(argv[5], std::ios::binary);
  f.write(reinterpret_cast<const char*>(y.const_data_ptr<float>()),
          static_cast<std::streamsize>(y.numel() * sizeof(float)));
  std::printf("output shape:");
  for (int64_t s : y.sizes()) std::printf(" %lld", (long long)s);
  std::printf("\n");
  return 0;
}
