// The Python module shell of trainer._C. Ops register themselves with TORCH_LIBRARY_FRAGMENT(slipway, m)
// in their own files and are called as torch.ops.slipway.<name>; this file only gives the shared
// library a PyInit symbol so `import trainer._C` loads it (and runs those static registrations).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipway compiled ops (see torch.ops.slipway)";
}
