#include "dflash2/error.h"

namespace dflash2 {

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::InvalidArgument: return "InvalidArgument";
    case ErrorKind::Checkpoint: return "Checkpoint";
    case ErrorKind::Config: return "Config";
    case ErrorKind::Unsupported: return "Unsupported";
    case ErrorKind::Backend: return "Backend";
    case ErrorKind::OutOfMemory: return "OutOfMemory";
    case ErrorKind::Internal: return "Internal";
    case ErrorKind::Numerical: return "Numerical";
  }
  return "?";
}

}  // namespace dflash2
