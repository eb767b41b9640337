# Precompiled <Kokkos_Core.hpp> for our own targets (BLOCKATTN_PCH, set by
# `cmake/blockattn.sh test`): every translation unit of the tests, examples,
# benchmarks and tools parses Kokkos' core headers first, ~2 s of a 2-core
# machine's core each (GCC 12, Kokkos 3.4.1) of ~250 files, 96 of them the
# header self-containment check's. With a precompiled copy a header-check
# file took 0.45 s instead of 2.4 s.
#
# The test executables on doctest's main (tests/CMakeLists.txt: test_main,
# mpi_main; not the emulated-GPU ones) get doctest's and the library's headers
# precompiled as well, a header per main and per (not) linking
# BlockAttn::kernels, whose BLOCKATTN_PRECOMPILED_KERNELS and extern set the
# library's headers read: ~1.5 s less per test file.
#
# GCC uses a precompiled header only where the compiling flags agree with
# those it was made with (the optimisation level, -fPIC / -fPIE; not the
# macros it does not read): one header is precompiled per optimisation level
# and position independence that at least `min_files` translation units
# share, by a small object library of its own, and each target of that
# level reuses it (REUSE_FROM). A target whose level or flags differ
# otherwise compiles Kokkos' headers as before: -Winvalid-pch (not an error)
# names any file that could not use it. Targets with the property
# BLOCKATTN_NO_PCH and GPU compilers are left alone.
#
# What the header self-containment check (tests/CMakeLists.txt) gives up:
# a header that reaches Kokkos through its own includes is still compiled
# on its own, but after Kokkos' headers; the headers that include neither
# Kokkos nor ours are checked without the precompiled header.

# The optimisation level (-O0 .. -O3, -Os, -Og) a target is compiled with in
# a Release build: the last one of its directory's CMAKE_CXX_FLAGS_RELEASE
# and its own compile options (generator expressions included as written).
function(_blockattn_target_opt target opts out)
  get_target_property(dir ${target} SOURCE_DIR)
  get_directory_property(flags DIRECTORY ${dir} DEFINITION CMAKE_CXX_FLAGS_RELEASE)
  string(REGEX MATCHALL "-O[0-3sg]" levels "${flags} ${opts}")
  if(levels)
    list(GET levels -1 level)
  else()
    set(level "-O0")
  endif()
  set(${out} ${level} PARENT_SCOPE)
endfunction()

# blockattn_precompiled_headers(<min_files> <dir>...): the targets defined
# in these directories (and the top level's), grouped as above.
function(blockattn_precompiled_headers min_files)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" OR Kokkos_ENABLE_CUDA OR Kokkos_ENABLE_HIP OR
     NOT CMAKE_BUILD_TYPE STREQUAL "Release")
    message(STATUS "BlockAttn: BLOCKATTN_PCH needs a host GCC or Clang Release build; not used")
    return()
  endif()
  set(targets "")
  foreach(dir ${PROJECT_SOURCE_DIR} ${ARGN})
    if(EXISTS ${dir})
      get_directory_property(t DIRECTORY ${dir} BUILDSYSTEM_TARGETS)
      list(APPEND targets ${t})
    endif()
  endforeach()
  set(keys "")
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    get_target_property(no_pch ${t} BLOCKATTN_NO_PCH)
    if(no_pch OR NOT type MATCHES "EXECUTABLE|OBJECT_LIBRARY|STATIC_LIBRARY")
      continue()
    endif()
    if(t MATCHES "^blockattn_pch_")
      continue()
    endif()
    get_target_property(sources ${t} SOURCES)
    list(FILTER sources INCLUDE REGEX "\\.(cpp|cc|cxx)$")
    list(LENGTH sources n)
    if(n EQUAL 0)
      continue()
    endif()
    get_target_property(opts ${t} COMPILE_OPTIONS)
    if(NOT opts)
      set(opts "")
    endif()
    if(opts AND BLOCKATTN_ARCH_FLAGS)
      list(REMOVE_ITEM opts ${BLOCKATTN_ARCH_FLAGS})  # every target's (blockattn_strict)
    endif()
    if(opts MATCHES "(^|;)-m")
      continue()  # an instruction set of its own (the ISA tests)
    endif()
    _blockattn_target_opt(${t} "${opts}" level)
    get_target_property(pic ${t} POSITION_INDEPENDENT_CODE)
    if(pic)
      set(key "${level}_pic")
    else()
      set(key "${level}")
    endif()
    # The test executables on doctest's main (not the emulated-GPU ones,
    # whose macros the library's headers read): the library's headers too.
    get_target_property(libs ${t} LINK_LIBRARIES)
    get_target_property(defs ${t} COMPILE_DEFINITIONS)
    if(libs MATCHES "blockattn_(test|mpi)_main" AND NOT libs MATCHES "blockattn_cuda_emu" AND
       NOT defs MATCHES "BLOCKATTN_EMULATE_FUSED")
      if(libs MATCHES "blockattn_mpi_main")
        set(key "${key}_mpi")
      elseif(libs MATCHES "blockattn_kernels")
        set(key "${key}_ktests")  # BLOCKATTN_PRECOMPILED_KERNELS
      else()
        set(key "${key}_tests")
      endif()
    endif()
    string(REPLACE "-" "" key "${key}")
    list(APPEND _ba_pch_${key} ${t})
    if(NOT DEFINED _ba_pch_${key}_files)
      set(_ba_pch_${key}_files 0)
    endif()
    math(EXPR _ba_pch_${key}_files "${_ba_pch_${key}_files} + ${n}")
    list(APPEND keys ${key})
  endforeach()
  list(REMOVE_DUPLICATES keys)
  set(dummy ${PROJECT_BINARY_DIR}/generated/blockattn_pch.cpp)
  file(WRITE ${dummy} "// The translation unit that precompiles <Kokkos_Core.hpp> (cmake/BlockAttnPch.cmake).\n")
  foreach(key IN LISTS keys)
    if(_ba_pch_${key}_files LESS min_files)
      continue()
    endif()
    set(host blockattn_pch_${key})
    add_library(${host} OBJECT ${dummy})
    target_link_libraries(${host} PRIVATE BlockAttn::blockattn)
    if(TARGET blockattn_strict)
      target_link_libraries(${host} PRIVATE blockattn_strict)
    endif()
    string(REGEX MATCH "O[0-3sg]" level "${key}")
    target_compile_options(${host} PRIVATE -${level})
    if(key MATCHES "_pic$")
      set_target_properties(${host} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    endif()
    if(key MATCHES "_(k?tests|mpi)$")
      # What a test file includes first, with the macros of its targets: the
      # precompiled kernels' extern set and BLOCKATTN_HOST_DISPATCH.
      # (the mains' usage requirements: doctest, BlockAttn::mpi and
      # BlockAttn::kernels for the MPI main; no objects of theirs)
      get_directory_property(tdefs DIRECTORY ${PROJECT_SOURCE_DIR}/tests COMPILE_DEFINITIONS)
      target_compile_definitions(${host} PRIVATE ${tdefs})
      set(headers <Kokkos_Core.hpp> <doctest/doctest.h> <blockattn/blockattn.hpp>)
      if(key MATCHES "_mpi$")
        target_link_libraries(${host} PRIVATE blockattn_mpi_main)
        list(APPEND headers <blockattn/mpi_communicator.hpp>)
      else()
        target_link_libraries(${host} PRIVATE blockattn_test_main)
        if(key MATCHES "_ktests$")
          target_link_libraries(${host} PRIVATE blockattn_kernels)
        endif()
      endif()
      target_precompile_headers(${host} PRIVATE ${headers})
      set(what "<Kokkos_Core.hpp>, doctest and the library's headers")
    else()
      target_precompile_headers(${host} PRIVATE <Kokkos_Core.hpp>)
      set(what "<Kokkos_Core.hpp>")
    endif()
    list(LENGTH _ba_pch_${key} count)
    foreach(t IN LISTS _ba_pch_${key})
      target_precompile_headers(${t} REUSE_FROM ${host})
      target_compile_options(${t} PRIVATE -Winvalid-pch -Wno-error=invalid-pch)
    endforeach()
    message(STATUS "BlockAttn: ${what} precompiled at -${level} for "
                   "${_ba_pch_${key}_files} files of ${count} targets")
  endforeach()
endfunction()
