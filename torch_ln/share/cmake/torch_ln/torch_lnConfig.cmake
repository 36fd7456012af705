# find_package(torch_ln) with torch_ln.cmake_prefix_path() on CMAKE_PREFIX_PATH gives the imported target
# torch_ln::torch_ln: the operator library libtorch_ln.so, its header <torch_ln/torch_ln.h>, and LibTorch.
# Linking it registers the torch_ln operators in the program, even one that never calls the C++ API
# (one that only runs an AOTInductor package, say).
include(CMakeFindDependencyMacro)
find_dependency(Torch)

# This file lies in <package>/share/cmake/torch_ln; the library and the header in <package>/lib and /include.
get_filename_component(_torch_ln_package "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(_torch_ln_library "${_torch_ln_package}/lib/libtorch_ln.so")
if(NOT EXISTS "${_torch_ln_library}")
  set(torch_ln_FOUND FALSE)
  set(torch_ln_NOT_FOUND_MESSAGE "${_torch_ln_library} is missing: build torch_ln first "
                                 "(pip install --no-build-isolation -e . in its repository)")
  return()
endif()

if(NOT TARGET torch_ln::torch_ln)
  add_library(torch_ln::torch_ln INTERFACE IMPORTED)
  # --no-as-needed: a linker that drops libraries nothing references (the default on Debian and Ubuntu) would
  # otherwise drop libtorch_ln from a program that uses the operators only through the dispatcher.
  # torch first: the loader then finds libtorch_ln's CUDA dependencies (libc10_cuda, libcudart) through torch's
  # libraries, which know where they lie, even when the program itself does not need them.
  # cxx_std_20: torch 2.14's headers need it. (A global CMAKE_CXX_STANDARD would also reach torch's CMake
  # config, which makes it the CUDA standard of its GPU probe, and nvcc rejects CUDA 20 there.)
  set_target_properties(torch_ln::torch_ln PROPERTIES
    INTERFACE_COMPILE_FEATURES cxx_std_20
    INTERFACE_INCLUDE_DIRECTORIES "${_torch_ln_package}/include"
    INTERFACE_LINK_LIBRARIES "torch;-Wl,--push-state,--no-as-needed;${_torch_ln_library};-Wl,--pop-state")
endif()

set(torch_ln_LIBRARY "${_torch_ln_library}")
unset(_torch_ln_library)
unset(_torch_ln_package)
