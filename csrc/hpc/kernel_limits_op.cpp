// The kernels' limits (kernel_limits.h) for Python, by name.
#include "kernel_limits_text.h"
#include "ops.h"

namespace hpc {

std::vector<std::string> kernel_limits() { return limits::named_limits(); }

}  // namespace hpc
