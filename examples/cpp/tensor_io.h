// Tensors in the files of Python's torch.save and torch.load: a list of them in, a tuple out.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

inline std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot read ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const c10::IValue list = torch::jit::pickle_load(bytes);  // named: the loop below borrows from it
  std::vector<at::Tensor> tensors;
  for (const auto& item : list.toListRef()) tensors.push_back(item.toTensor());
  return tensors;
}

inline void save_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  // A tuple: torch.load (weights_only) reads it, where a typed List[Tensor] would need an allowlisted global.
  const auto tuple = c10::ivalue::Tuple::create(std::vector<c10::IValue>(tensors.begin(), tensors.end()));
  const std::vector<char> bytes = torch::jit::pickle_save(tuple);
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(file, "cannot write ", path);
}
