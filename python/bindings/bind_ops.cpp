// placeholder: being written
#include "bindings.h"
namespace dflash2::py_bind { void bind_ops(py::module_& m) { m.def_submodule("ops"); } }
