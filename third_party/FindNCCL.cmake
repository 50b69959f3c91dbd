# FindNCCL.cmake: locates NCCL (header nccl.h and libnccl.so*). Nothing is downloaded.
#
# Search order:
#   1. NCCL_ROOT / NCCL_HOME (CMake variables, then environment): <root>/include, <root>/lib*
#   2. The `nvidia-nccl-cu13` (or -cu12) wheel: nvidia/nccl/{include,lib}. nvidia.nccl is a
#      namespace package, so it is located with
#      importlib.util.find_spec('nvidia.nccl').submodule_search_locations, asking the Python
#      interpreter (Python3_EXECUTABLE, Python_EXECUTABLE, then python3 / python on PATH).
#   3. System locations (/usr, /usr/local, the CUDA toolkit, CMAKE_PREFIX_PATH, ...).
#
# Result variables:
#   NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES (the libnccl.so* path), NCCL_VERSION
#   ("2.27.7", from nccl.h), and the imported target NCCL::NCCL.
# The wheel ships only libnccl.so.2 (no libnccl.so link), so that name is searched too.
include(FindPackageHandleStandardArgs)

set(_nccl_roots "")
foreach(_v NCCL_ROOT NCCL_HOME)
  if(${_v})
    list(APPEND _nccl_roots "${${_v}}")
  endif()
  if(DEFINED ENV{${_v}} AND NOT "$ENV{${_v}}" STREQUAL "")
    list(APPEND _nccl_roots "$ENV{${_v}}")
  endif()
endforeach()

# The Python wheel (only asked when no explicit root is given).
set(_nccl_wheel_dirs "")
if(NOT _nccl_roots)
  set(_nccl_pythons "")
  foreach(_p IN ITEMS "${Python3_EXECUTABLE}" "${Python_EXECUTABLE}")
    if(_p)
      list(APPEND _nccl_pythons "${_p}")
    endif()
  endforeach()
  find_program(_nccl_python3 NAMES python3 python NO_CACHE)
  if(_nccl_python3)
    list(APPEND _nccl_pythons "${_nccl_python3}")
  endif()
  list(REMOVE_DUPLICATES _nccl_pythons)
  foreach(_py IN LISTS _nccl_pythons)
    execute_process(
      COMMAND "${_py}" -c
        "import importlib.util\ntry:\n    s = importlib.util.find_spec('nvidia.nccl')\nexcept Exception:\n    s = None\nprint(';'.join(s.submodule_search_locations) if s and s.submodule_search_locations else '')"
      OUTPUT_VARIABLE _nccl_out OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET RESULT_VARIABLE _nccl_rc TIMEOUT 60)
    if(_nccl_rc EQUAL 0 AND _nccl_out)
      foreach(_d IN LISTS _nccl_out)
        if(EXISTS "${_d}/include/nccl.h")
          list(APPEND _nccl_wheel_dirs "${_d}")
        endif()
      endforeach()
      if(_nccl_wheel_dirs)
        break()
      endif()
    endif()
  endforeach()
endif()

set(_nccl_lib_names nccl libnccl.so.2)
if(_nccl_roots OR _nccl_wheel_dirs)
  # explicit locations only: do not silently pick a different system copy
  find_path(NCCL_INCLUDE_DIR nccl.h
    PATHS ${_nccl_roots} ${_nccl_wheel_dirs} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES ${_nccl_lib_names}
    PATHS ${_nccl_roots} ${_nccl_wheel_dirs} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu
    NO_DEFAULT_PATH)
else()
  set(_nccl_hints "")
  if(CUDAToolkit_LIBRARY_ROOT)
    list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}")
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES ${_nccl_lib_names} HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
endif()

set(NCCL_VERSION "")
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver_lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    set(_nccl_${_part} "")
    foreach(_line IN LISTS _nccl_ver_lines)
      if(_line MATCHES "^#define NCCL_${_part} +([0-9]+)")
        set(_nccl_${_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "" AND NOT _nccl_MINOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}")
    if(NOT _nccl_PATCH STREQUAL "")
      string(APPEND NCCL_VERSION ".${_nccl_PATCH}")
    endif()
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE
    "set NCCL_ROOT to an NCCL install, or pip install nvidia-nccl-cu13 into the Python that CMake runs")

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
else()
  set(NCCL_INCLUDE_DIRS "")
  set(NCCL_LIBRARIES "")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
