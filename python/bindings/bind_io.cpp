// placeholder: being written
#include "bindings.h"
namespace dflash2::py_bind { void bind_io(py::module_& m) {} }
