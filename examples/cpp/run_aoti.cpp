// Runs an AOTInductor package from C++: run_aoti MODEL.pt2 INPUTS.pt OUTPUTS.pt (the package and the inputs from
// make_model.py). Nothing here calls torch_ln: the package calls its operators through the dispatcher, which
// has them because this program links torch_ln::torch_ln.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <iostream>

#include "tensor_io.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: run_aoti MODEL.pt2 INPUTS.pt OUTPUTS.pt" << std::endl;
    return 2;
  }
  const bool registered = c10::Dispatcher::singleton().findSchema({"torch_ln::layer_norm_fwd", ""}).has_value();
  std::cout << "torch_ln::layer_norm_fwd registered: " << (registered ? "yes" : "no") << std::endl;
  if (!registered) return 1;
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  const auto outputs = loader.run(load_tensors(argv[2]));
  save_tensors(argv[3], outputs);
  std::cout << "ran " << argv[1] << ": " << outputs.size() << " output(s), the first of shape " << outputs.at(0).sizes()
            << std::endl;
  return 0;
}
