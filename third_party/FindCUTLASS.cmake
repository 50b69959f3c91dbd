# FindCUTLASS.cmake: locates the CUTLASS / CuTe C++ headers. Nothing is downloaded.
#
# Search order:
#   1. CUTLASS_DIR (CMake variable, then environment): a CUTLASS source tree or install
#      prefix holding include/cutlass/version.h (tools/util/include is used when present).
#   2. The `nvidia-cutlass` wheel: <cutlass_library>/source/include, found by asking the Python
#      interpreter (Python3_EXECUTABLE, Python_EXECUTABLE, then python3 / python on PATH).
#
# Result variables:
#   CUTLASS_FOUND, CUTLASS_INCLUDE_DIRS (include + tools/util/include), CUTLASS_VERSION,
#   CUTLASS_ROOT (the directory that holds include/), and the imported target CUTLASS::CUTLASS
#   (INTERFACE, headers only).
include(FindPackageHandleStandardArgs)

set(CUTLASS_ROOT "")
foreach(_d IN ITEMS "${CUTLASS_DIR}" "$ENV{CUTLASS_DIR}")
  if(NOT _d OR CUTLASS_ROOT)
    continue()
  endif()
  if(EXISTS "${_d}/include/cutlass/version.h")
    set(CUTLASS_ROOT "${_d}")
  elseif(EXISTS "${_d}/cutlass/version.h")  # CUTLASS_DIR pointing at the include dir itself
    get_filename_component(CUTLASS_ROOT "${_d}" DIRECTORY)
  elseif(NOT CUTLASS_FIND_QUIETLY)
    message(STATUS "FindCUTLASS: CUTLASS_DIR=${_d} has no include/cutlass/version.h, ignored")
  endif()
endforeach()

# The header-only wheel: ask Python where cutlass_library lives (find_spec does not import it).
if(NOT CUTLASS_ROOT)
  set(_cutlass_pythons "")
  foreach(_p IN ITEMS "${Python3_EXECUTABLE}" "${Python_EXECUTABLE}")
    if(_p)
      list(APPEND _cutlass_pythons "${_p}")
    endif()
  endforeach()
  find_program(_cutlass_python3 NAMES python3 python NO_CACHE)
  if(_cutlass_python3)
    list(APPEND _cutlass_pythons "${_cutlass_python3}")
  endif()
  list(REMOVE_DUPLICATES _cutlass_pythons)
  foreach(_py IN LISTS _cutlass_pythons)
    execute_process(
      COMMAND "${_py}" -c
        "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source') if s and s.origin else '')"
      OUTPUT_VARIABLE _cutlass_src OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET RESULT_VARIABLE _cutlass_rc TIMEOUT 60)
    if(_cutlass_rc EQUAL 0 AND _cutlass_src AND EXISTS "${_cutlass_src}/include/cutlass/version.h")
      set(CUTLASS_ROOT "${_cutlass_src}")
      break()
    endif()
  endforeach()
endif()

set(CUTLASS_INCLUDE_DIR "")
set(CUTLASS_VERSION "")
if(CUTLASS_ROOT)
  get_filename_component(CUTLASS_ROOT "${CUTLASS_ROOT}" REALPATH)
  set(CUTLASS_INCLUDE_DIR "${CUTLASS_ROOT}/include")
  file(STRINGS "${CUTLASS_INCLUDE_DIR}/cutlass/version.h" _cutlass_ver_lines
       REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    set(_cutlass_${_part} "")
    foreach(_line IN LISTS _cutlass_ver_lines)
      if(_line MATCHES "^#define CUTLASS_${_part} +([0-9]+)")
        set(_cutlass_${_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT _cutlass_MAJOR STREQUAL "" AND NOT _cutlass_MINOR STREQUAL "")
    set(CUTLASS_VERSION "${_cutlass_MAJOR}.${_cutlass_MINOR}")
    if(NOT _cutlass_PATCH STREQUAL "")
      string(APPEND CUTLASS_VERSION ".${_cutlass_PATCH}")
    endif()
  endif()
endif()

find_package_handle_standard_args(CUTLASS
  REQUIRED_VARS CUTLASS_INCLUDE_DIR
  VERSION_VAR CUTLASS_VERSION
  REASON_FAILURE_MESSAGE
    "set CUTLASS_DIR to a CUTLASS tree, or pip install nvidia-cutlass into the Python that CMake runs")

if(CUTLASS_FOUND)
  set(CUTLASS_INCLUDE_DIRS "${CUTLASS_INCLUDE_DIR}")
  if(EXISTS "${CUTLASS_ROOT}/tools/util/include")
    list(APPEND CUTLASS_INCLUDE_DIRS "${CUTLASS_ROOT}/tools/util/include")
  endif()
  if(NOT TARGET CUTLASS::CUTLASS)
    add_library(CUTLASS::CUTLASS INTERFACE IMPORTED)
    set_target_properties(CUTLASS::CUTLASS PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CUTLASS_INCLUDE_DIRS}")
  endif()
else()
  set(CUTLASS_INCLUDE_DIRS "")
endif()
mark_as_advanced(CUTLASS_INCLUDE_DIR)
