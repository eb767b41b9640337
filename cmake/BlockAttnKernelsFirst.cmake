# BlockAttn::kernels' objects first on the link line of this tree's
# executables that link it (tests, examples, tools, benchmarks).
#
# The block products it precompiles call inline helpers (the SIMD micro
# kernels, exp2, 16-bit conversions) that every other file instantiating a
# kernel of its own (a mask of the tests, a type the set leaves out) also
# emits, as weak symbols. A static library's members come after the
# program's objects, so the linker kept the objects' copies for the whole
# program: in the test build (test files at -O0, the library at -O1) the
# precompiled kernels ran their -O0 helpers out of line
# (blockattn_test_distributed_serial: 6.5 s -> 4.1 s on one core of a
# Zen 3 with the library's copies). Whole-archive before the objects keeps
# the library's copies for everyone; the archive's later mention adds
# nothing. GNU ld / lld (ELF) only.
function(blockattn_kernels_objects_first)
  if(NOT TARGET blockattn_kernels OR NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR
     NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  set(count 0)
  foreach(dir ${ARGN})
    if(NOT EXISTS ${dir})
      continue()
    endif()
    get_directory_property(targets DIRECTORY ${dir} BUILDSYSTEM_TARGETS)
    foreach(t IN LISTS targets)
      get_target_property(type ${t} TYPE)
      get_target_property(libs ${t} LINK_LIBRARIES)
      # Directly, or through the tests' MPI main (which links it PUBLIC).
      if(type STREQUAL "EXECUTABLE" AND libs MATCHES "blockattn_kernels|blockattn_mpi_main")
        target_link_options(${t} BEFORE PRIVATE
          "SHELL:-Wl,--whole-archive $<TARGET_FILE:blockattn_kernels> -Wl,--no-whole-archive")
        math(EXPR count "${count} + 1")
      endif()
    endforeach()
  endforeach()
  message(STATUS "BlockAttn: BlockAttn::kernels linked before the objects of ${count} executables")
endfunction()
