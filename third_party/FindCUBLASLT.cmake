# FindCUBLASLT.cmake: locates the cuBLASLt header (cublasLt.h) and library
# (libcublasLt.so*). Nothing is downloaded and nothing links against the library: the only
# user, bench/cpp/bench_ops (the cuBLASLt baseline of the GEMM microbenchmarks), dlopen()s
# it at run time, so a build machine only needs the headers.
#
# Search order:
#   1. CUBLASLT_ROOT (CMake variable, then environment): <root>/include, <root>/lib*
#   2. The `nvidia-cublas` wheel (CUDA 13: nvidia/cu13/{include,lib}; the CUDA 12 wheel
#      `nvidia-cublas-cu12`: nvidia/cublas/{include,lib}), located with
#      importlib.util.find_spec('nvidia.cu13' | 'nvidia.cublas').submodule_search_locations
#      by the Python interpreter (Python3_EXECUTABLE, Python_EXECUTABLE, then python3 /
#      python on PATH).
#   3. The CUDA toolkit and system locations (a full toolkit ships cuBLAS; CUDA 13.0
#      installs without it are common, hence the wheel).
#
# Result variables:
#   CUBLASLT_FOUND, CUBLASLT_INCLUDE_DIRS, CUBLASLT_LIBRARY (the libcublasLt.so* path, for
#   dlopen; may be empty when only the header was found), CUBLASLT_VERSION ("13.1.0", from
#   cublas_api.h). The wheel ships only libcublasLt.so.13 (no libcublasLt.so link), so the
#   versioned names are searched too.
include(FindPackageHandleStandardArgs)

set(_cublaslt_roots "")
if(CUBLASLT_ROOT)
  list(APPEND _cublaslt_roots "${CUBLASLT_ROOT}")
endif()
if(DEFINED ENV{CUBLASLT_ROOT} AND NOT "$ENV{CUBLASLT_ROOT}" STREQUAL "")
  list(APPEND _cublaslt_roots "$ENV{CUBLASLT_ROOT}")
endif()

set(_cublaslt_wheel_dirs "")
if(NOT _cublaslt_roots)
  set(_cublaslt_pythons "")
  foreach(_p IN ITEMS "${Python3_EXECUTABLE}" "${Python_EXECUTABLE}")
    if(_p)
      list(APPEND _cublaslt_pythons "${_p}")
    endif()
  endforeach()
  find_program(_cublaslt_python3 NAMES python3 python NO_CACHE)
  if(_cublaslt_python3)
    list(APPEND _cublaslt_pythons "${_cublaslt_python3}")
  endif()
  list(REMOVE_DUPLICATES _cublaslt_pythons)
  foreach(_py IN LISTS _cublaslt_pythons)
    execute_process(
      COMMAND "${_py}" -c
        "import importlib.util\nout = []\nfor m in ('nvidia.cu13', 'nvidia.cublas'):\n    try:\n        s = importlib.util.find_spec(m)\n    except Exception:\n        s = None\n    if s and s.submodule_search_locations:\n        out += list(s.submodule_search_locations)\nprint(';'.join(out))"
      OUTPUT_VARIABLE _cublaslt_out OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET RESULT_VARIABLE _cublaslt_rc TIMEOUT 60)
    if(_cublaslt_rc EQUAL 0 AND _cublaslt_out)
      foreach(_d IN LISTS _cublaslt_out)
        if(EXISTS "${_d}/include/cublasLt.h")
          list(APPEND _cublaslt_wheel_dirs "${_d}")
        endif()
      endforeach()
      if(_cublaslt_wheel_dirs)
        break()
      endif()
    endif()
  endforeach()
endif()

set(_cublaslt_lib_names cublasLt libcublasLt.so.13 libcublasLt.so.12)
if(_cublaslt_roots OR _cublaslt_wheel_dirs)
  # explicit locations only: do not silently pick a different system copy
  find_path(CUBLASLT_INCLUDE_DIR cublasLt.h
    PATHS ${_cublaslt_roots} ${_cublaslt_wheel_dirs} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(CUBLASLT_LIBRARY NAMES ${_cublaslt_lib_names}
    PATHS ${_cublaslt_roots} ${_cublaslt_wheel_dirs} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu
    NO_DEFAULT_PATH)
else()
  set(_cublaslt_hints "")
  if(CUDAToolkit_LIBRARY_ROOT)
    list(APPEND _cublaslt_hints "${CUDAToolkit_LIBRARY_ROOT}")
  endif()
  if(CUDAToolkit_INCLUDE_DIRS)
    list(APPEND _cublaslt_hints ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  find_path(CUBLASLT_INCLUDE_DIR cublasLt.h HINTS ${_cublaslt_hints} PATH_SUFFIXES include)
  find_library(CUBLASLT_LIBRARY NAMES ${_cublaslt_lib_names} HINTS ${_cublaslt_hints} PATH_SUFFIXES lib lib64)
endif()

set(CUBLASLT_VERSION "")
if(CUBLASLT_INCLUDE_DIR AND EXISTS "${CUBLASLT_INCLUDE_DIR}/cublas_api.h")
  file(STRINGS "${CUBLASLT_INCLUDE_DIR}/cublas_api.h" _cublaslt_ver_lines
    REGEX "^#define CUBLAS_VER_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    set(_cublaslt_${_part} "")
    foreach(_line IN LISTS _cublaslt_ver_lines)
      if(_line MATCHES "^#define CUBLAS_VER_${_part} +([0-9]+)")
        set(_cublaslt_${_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT _cublaslt_MAJOR STREQUAL "" AND NOT _cublaslt_MINOR STREQUAL "")
    set(CUBLASLT_VERSION "${_cublaslt_MAJOR}.${_cublaslt_MINOR}")
    if(NOT _cublaslt_PATCH STREQUAL "")
      string(APPEND CUBLASLT_VERSION ".${_cublaslt_PATCH}")
    endif()
  endif()
endif()

# The header is what the build needs; the library path is only a default for dlopen.
find_package_handle_standard_args(CUBLASLT
  REQUIRED_VARS CUBLASLT_INCLUDE_DIR
  VERSION_VAR CUBLASLT_VERSION
  REASON_FAILURE_MESSAGE
    "set CUBLASLT_ROOT to a cuBLAS install, or pip install nvidia-cublas into the Python that CMake runs (only the cuBLASLt baseline of bench_ops needs it)")

if(CUBLASLT_FOUND)
  set(CUBLASLT_INCLUDE_DIRS "${CUBLASLT_INCLUDE_DIR}")
  if(NOT CUBLASLT_LIBRARY)
    set(CUBLASLT_LIBRARY "")
  endif()
else()
  set(CUBLASLT_INCLUDE_DIRS "")
endif()
mark_as_advanced(CUBLASLT_INCLUDE_DIR CUBLASLT_LIBRARY)
