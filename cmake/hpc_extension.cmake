# Defines the `_hpc_C` extension target (vllm/_hpc_C.abi3.so, sm_90a).
#
# Included by this project's CMakeLists.txt and, after the patch set is
# applied to a vLLM source checkout, by vLLM's own CMakeLists.txt. Needs a
# Python interpreter with torch (HPC_PYTHON, else Python_EXECUTABLE or
# Python3_EXECUTABLE) and CUDA enabled as a language. CUTLASS/CuTe headers come
# from CUTLASS_DIR (a CUTLASS checkout) or from the nvidia-cutlass package.

set(HPC_SOURCE_DIR "${CMAKE_CURRENT_LIST_DIR}/../csrc/hpc")

if(NOT HPC_PYTHON)
  if(Python_EXECUTABLE)
    set(HPC_PYTHON "${Python_EXECUTABLE}")
  elseif(Python3_EXECUTABLE)
    set(HPC_PYTHON "${Python3_EXECUTABLE}")
  else()
    find_package(Python3 REQUIRED COMPONENTS Interpreter)
    set(HPC_PYTHON "${Python3_EXECUTABLE}")
  endif()
endif()

# One query for everything taken from the Python side: torch's headers and
# libraries, its C++ ABI, the Python headers and the CUTLASS headers.
execute_process(
  COMMAND "${HPC_PYTHON}" -c "
import importlib.util, os, sysconfig, torch
torch_dir = os.path.dirname(torch.__file__)
print(os.path.join(torch_dir, 'include'))
print(os.path.join(torch_dir, 'lib'))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_paths()['include'])
spec = importlib.util.find_spec('cutlass_library')
print(os.path.join(list(spec.submodule_search_locations)[0], 'source') if spec else '')
"
  OUTPUT_VARIABLE _hpc_py_out
  RESULT_VARIABLE _hpc_py_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _hpc_py_rc EQUAL 0)
  message(FATAL_ERROR "_hpc_C: ${HPC_PYTHON} could not import torch")
endif()
string(REPLACE "\n" ";" _hpc_py_out "${_hpc_py_out}")
list(GET _hpc_py_out 0 HPC_TORCH_INCLUDE)
list(GET _hpc_py_out 1 HPC_TORCH_LIBDIR)
list(GET _hpc_py_out 2 HPC_CXX11_ABI)
list(GET _hpc_py_out 3 HPC_PYTHON_INCLUDE)
list(GET _hpc_py_out 4 HPC_CUTLASS_PKG_DIR)

if(NOT CUTLASS_DIR AND DEFINED ENV{CUTLASS_DIR})
  set(CUTLASS_DIR "$ENV{CUTLASS_DIR}")
endif()
if(NOT CUTLASS_DIR)
  set(CUTLASS_DIR "${HPC_CUTLASS_PKG_DIR}")
endif()
if(NOT EXISTS "${CUTLASS_DIR}/include/cute/tensor.hpp")
  message(FATAL_ERROR
    "_hpc_C: CUTLASS headers not found; install nvidia-cutlass or set CUTLASS_DIR")
endif()

find_package(CUDAToolkit REQUIRED)

file(GLOB_RECURSE HPC_SOURCES CONFIGURE_DEPENDS
  "${HPC_SOURCE_DIR}/*.cu" "${HPC_SOURCE_DIR}/*.cpp")

add_library(_hpc_C MODULE ${HPC_SOURCES})
set_target_properties(_hpc_C PROPERTIES
  PREFIX ""
  OUTPUT_NAME "_hpc_C"
  SUFFIX ".abi3.so"
  CUDA_ARCHITECTURES OFF
  CUDA_RUNTIME_LIBRARY Shared
  CXX_STANDARD 20
  CUDA_STANDARD 20
  POSITION_INDEPENDENT_CODE ON
  # Only PyInit__hpc_C is exported: the ops register through static
  # initializers, and the stable headers' inline code (c10::toString of a
  # dtype) stays private to the library rather than shared with other
  # extensions built against other torch headers.
  CXX_VISIBILITY_PRESET hidden
  CUDA_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON)
target_include_directories(_hpc_C PRIVATE
  "${HPC_SOURCE_DIR}"
  "${CUTLASS_DIR}/include"
  "${CUTLASS_DIR}/tools/util/include")
target_include_directories(_hpc_C SYSTEM PRIVATE
  "${HPC_TORCH_INCLUDE}"
  "${HPC_PYTHON_INCLUDE}"
  ${CUDAToolkit_INCLUDE_DIRS})
# The adapters use torch's stable C ABI only, as vLLM's extensions do: the
# target version keeps to the shims torch 2.11 has (and makes every non-stable
# torch header an error), USE_CUDA declares the CUDA shims (current stream).
target_compile_definitions(_hpc_C PRIVATE
  Py_LIMITED_API=0x03090000
  TORCH_TARGET_VERSION=0x020B000000000000ULL
  USE_CUDA
  _GLIBCXX_USE_CXX11_ABI=${HPC_CXX11_ABI})
target_compile_options(_hpc_C PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:
    -gencode=arch=compute_90a,code=sm_90a
    --expt-relaxed-constexpr
    -lineinfo
    -O3>
  $<$<COMPILE_LANGUAGE:CXX>:-O2>)
target_link_directories(_hpc_C PRIVATE "${HPC_TORCH_LIBDIR}")
# The stable shims live in these two; nothing else of torch is linked.
target_link_libraries(_hpc_C PRIVATE torch_cpu torch_cuda CUDA::cudart)
set_target_properties(_hpc_C PROPERTIES
  BUILD_RPATH "${HPC_TORCH_LIBDIR}"
  INSTALL_RPATH "${HPC_TORCH_LIBDIR}")
install(TARGETS _hpc_C LIBRARY DESTINATION vllm COMPONENT _hpc_C)
