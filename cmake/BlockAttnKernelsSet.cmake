# Which block products BlockAttn::kernels precompiles (BLOCKATTN_KERNELS_SET),
# as Kokkos Kernels' ETI options choose scalars, layouts and spaces.
#
# A selector is Backend:Mask:Positions:direction:types, '*' for any:
#   Backend    a host backend of this Kokkos: Serial, OpenMP
#   Mask       FullMask, CausalMask, SlidingWindowMask, PrefixLMMask, DocumentMask
#   Positions  Affine (single device; contiguous, striped, zigzag partitions),
#              Table (TablePartition)
#   direction  forward, backward
#   types      fp64, fp32, bf16, fp16 (16-bit storage computed in fp32), and
#              bf16-fp32, fp16-fp32 (16-bit inputs, fp32 outputs: the
#              distributed drivers' partial results and gradient accumulators)
# The set is every block product some selector matches; an item @file reads
# selectors from a file (one per line, '#' comments; relative paths from the
# source directory). Default "*:*:*:*:*": everything, 240 instantiations with
# two host backends. What the set leaves out is compiled, as without the
# library, in every file that calls it.
#
# blockattn_kernels_set_generate(<out_sources>) writes, into the build tree,
#   kernels/block_product_<Backend>_<Mask>.cpp   the set's instantiations, one
#                                                file per backend and mask that
#                                                has any (returned)
#   generated/blockattn_precompiled_set.hpp      the same, declared extern
#                                                (kernel/instantiate.hpp)
# and sets, for the tests, BLOCKATTN_KERNELS_SET_FILE (the @file, if one was
# given) and BLOCKATTN_KERNELS_SET_SELECTORS (the selectors, @files read).
# What the set leaves out is run by ctest kernels_<backend>
# (tests/test_kernel_matrix.cpp compiles it).

set(_ba_ks_masks FullMask CausalMask SlidingWindowMask PrefixLMMask DocumentMask)
set(_ba_ks_positions Affine Table)
set(_ba_ks_directions forward backward)
set(_ba_ks_types fp64 fp32 bf16 bf16-fp32 fp16 fp16-fp32)
set(_ba_ks_args_fp64 "double, double, double")
set(_ba_ks_args_fp32 "float, float, float")
set(_ba_ks_args_bf16 "float, ::blockattn::bf16, ::blockattn::bf16")
set(_ba_ks_args_bf16-fp32 "float, ::blockattn::bf16, float")
set(_ba_ks_args_fp16 "float, ::blockattn::fp16, ::blockattn::fp16")
set(_ba_ks_args_fp16-fp32 "float, ::blockattn::fp16, float")

function(_blockattn_ks_fail item why)
  message(FATAL_ERROR "BlockAttn: BLOCKATTN_KERNELS_SET: '${item}': ${why}; expected selectors "
                      "Backend:Mask:Positions:direction:types, each field '*' or one of "
                      "Backend {Serial, OpenMP}, Mask {${_ba_ks_masks}}, Positions {Affine, Table}, "
                      "direction {forward, backward}, types {${_ba_ks_types}}, or @file "
                      "(cmake/BlockAttnKernelsSet.cmake)")
endfunction()

# The selectors of BLOCKATTN_KERNELS_SET, @files read, each checked.
function(_blockattn_ks_selectors out)
  set(result "")
  set(file "")
  foreach(item IN LISTS BLOCKATTN_KERNELS_SET)
    if(item MATCHES "^@(.+)$")
      set(path "${CMAKE_MATCH_1}")
      if(NOT IS_ABSOLUTE "${path}")
        set(path "${PROJECT_SOURCE_DIR}/${path}")
      endif()
      if(NOT EXISTS "${path}")
        _blockattn_ks_fail("${item}" "no such file")
      endif()
      set_property(DIRECTORY "${PROJECT_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
                                                                      "${path}")
      set(file "${path}")
      file(STRINGS "${path}" lines)
      foreach(line IN LISTS lines)
        string(REGEX REPLACE "#.*" "" line "${line}")
        string(STRIP "${line}" line)
        if(NOT line STREQUAL "")
          list(APPEND result "${line}")
        endif()
      endforeach()
    elseif(NOT item STREQUAL "")
      list(APPEND result "${item}")
    endif()
  endforeach()
  foreach(sel IN LISTS result)
    string(REPLACE ":" ";" f "${sel}")
    list(LENGTH f n)
    if(NOT n EQUAL 5)
      _blockattn_ks_fail("${sel}" "${n} fields")
    endif()
    list(GET f 0 b)
    list(GET f 1 m)
    list(GET f 2 p)
    list(GET f 3 d)
    list(GET f 4 t)
    foreach(pair "b;Serial;OpenMP" "m;${_ba_ks_masks}" "p;${_ba_ks_positions}"
                 "d;${_ba_ks_directions}" "t;${_ba_ks_types}")
      list(GET pair 0 var)
      list(REMOVE_AT pair 0)
      if(NOT "${${var}}" STREQUAL "*" AND NOT "${${var}}" IN_LIST pair)
        _blockattn_ks_fail("${sel}" "unknown '${${var}}'")
      endif()
    endforeach()
  endforeach()
  if(NOT result)
    _blockattn_ks_fail("${BLOCKATTN_KERNELS_SET}" "no selector")
  endif()
  set(${out} "${result}" PARENT_SCOPE)
  set(BLOCKATTN_KERNELS_SET_FILE "${file}" PARENT_SCOPE)
endfunction()

function(blockattn_kernels_set_generate out_sources)
  _blockattn_ks_selectors(selectors)
  # Each selector as a regular expression over "Backend:Mask:Positions:direction:types"
  # (its fields are checked names or '*').
  set(patterns "")
  foreach(sel IN LISTS selectors)
    string(REPLACE "*" "[^:]+" re "${sel}")
    list(APPEND patterns "^${re}$")
  endforeach()
  set(sources "")
  set(externs "")
  set(count 0)
  foreach(backend IN LISTS BLOCKATTN_BACKENDS)
    string(TOUPPER "${backend}" upper)
    set(backend_externs "")
    foreach(mask IN LISTS _ba_ks_masks)
      set(lines "")
      foreach(pos IN LISTS _ba_ks_positions)
        foreach(dir IN LISTS _ba_ks_directions)
          string(TOUPPER "${dir}" kind)
          foreach(type IN LISTS _ba_ks_types)
            set(selected OFF)
            foreach(re IN LISTS patterns)
              if("${backend}:${mask}:${pos}:${dir}:${type}" MATCHES "${re}")
                set(selected ON)
                break()
              endif()
            endforeach()
            set(args "Kokkos::${backend}, ${_ba_ks_args_${type}}, ::blockattn::${mask}, ::blockattn::${pos}Positions")
            if(selected)
              string(APPEND lines "BLOCKATTN_IMPL_${kind}_BLOCK(, ${args})\n")
              string(APPEND backend_externs "BLOCKATTN_IMPL_${kind}_BLOCK(extern, ${args})\n")
              math(EXPR count "${count} + 1")
            endif()
          endforeach()
        endforeach()
      endforeach()
      if(NOT lines STREQUAL "")
        set(BLOCKATTN_KERNELS_INSTANTIATIONS "${lines}")
        set(src "${PROJECT_BINARY_DIR}/kernels/block_product_${backend}_${mask}.cpp")
        configure_file("${PROJECT_SOURCE_DIR}/src/block_product.cpp.in" "${src}" @ONLY)
        list(APPEND sources "${src}")
      endif()
    endforeach()
    if(NOT backend_externs STREQUAL "")
      string(APPEND externs "#if defined(KOKKOS_ENABLE_${upper})\n${backend_externs}#endif\n")
    endif()
  endforeach()
  if(count EQUAL 0)
    _blockattn_ks_fail("${BLOCKATTN_KERNELS_SET}"
                       "selects nothing on this Kokkos (${BLOCKATTN_BACKENDS}); "
                       "-DBLOCKATTN_BUILD_KERNELS=OFF builds no library")
  endif()
  set(BLOCKATTN_KERNELS_EXTERNS "${externs}")
  configure_file("${PROJECT_SOURCE_DIR}/src/precompiled_set.hpp.in"
                 "${PROJECT_BINARY_DIR}/generated/blockattn_precompiled_set.hpp" @ONLY)
  message(STATUS "BlockAttn::kernels: ${count} block products (BLOCKATTN_KERNELS_SET)")
  set(${out_sources} "${sources}" PARENT_SCOPE)
  set(BLOCKATTN_KERNELS_SET_FILE "${BLOCKATTN_KERNELS_SET_FILE}" PARENT_SCOPE)
  set(BLOCKATTN_KERNELS_SET_SELECTORS "${selectors}" PARENT_SCOPE)
endfunction()

# The targets of <dirs> that link blockattn_kernels, directly or through a
# library of theirs (e.g. an OBJECT main that links it PUBLIC).
function(_blockattn_ks_links_kernels target out)
  set(${out} OFF PARENT_SCOPE)
  get_target_property(type ${target} TYPE)
  set(libs "")
  if(NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(libs ${target} LINK_LIBRARIES)
  endif()
  get_target_property(ilibs ${target} INTERFACE_LINK_LIBRARIES)
  foreach(lib IN LISTS libs ilibs)
    # $<TARGET_NAME_IF_EXISTS:x>, $<LINK_ONLY:x>: the name inside
    string(REGEX REPLACE "^\\$<[A-Z_]+:(.*)>$" "\\1" lib "${lib}")
    if(lib STREQUAL "blockattn_kernels" OR lib STREQUAL "BlockAttn::kernels")
      set(${out} ON PARENT_SCOPE)
      return()
    endif()
    if(TARGET "${lib}" AND NOT lib MATCHES "^(blockattn|blockattn_mpi|blockattn_strict)$"
       AND NOT lib MATCHES "::")
      _blockattn_ks_links_kernels(${lib} sub)
      if(sub)
        set(${out} ON PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
endfunction()

# Tests (with BlockAttn's tests, after every directory is added):
# kernels_set_matches_tests, when the set came from a file: the file is the
# set of precompiled block products that the tests, examples, tools and
# benchmarks call (tests/kernels_used.sh; the objects of the targets that link
# the library: <build>/kernels/objects_linking_kernels.txt; targets with the
# property BLOCKATTN_CALLS_EVERY_KERNEL, which call every block product by
# design, are not counted).
function(blockattn_kernels_set_tests)
  set(objects "")
  get_property(dirs DIRECTORY "${PROJECT_SOURCE_DIR}" PROPERTY SUBDIRECTORIES)
  foreach(dir IN LISTS dirs)
    get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
    foreach(t IN LISTS targets)
      get_target_property(type ${t} TYPE)
      get_target_property(excluded ${t} EXCLUDE_FROM_ALL)
      get_target_property(every ${t} BLOCKATTN_CALLS_EVERY_KERNEL)
      if(excluded OR every OR NOT type MATCHES "^(EXECUTABLE|OBJECT_LIBRARY|STATIC_LIBRARY)$")
        continue()
      endif()
      _blockattn_ks_links_kernels(${t} links)
      if(links)
        string(APPEND objects "$<JOIN:$<TARGET_OBJECTS:${t}>,\n>\n")
      endif()
    endforeach()
  endforeach()
  file(GENERATE OUTPUT "${PROJECT_BINARY_DIR}/kernels/objects_linking_kernels.txt"
       CONTENT "${objects}")
  if(NOT BLOCKATTN_KERNELS_SET_FILE)
    return()
  endif()
  # The file is what the suite calls on a Kokkos with its backends (the
  # script's Serial + OpenMP); another Kokkos calls other kernels.
  set(file_backends "")
  foreach(sel IN LISTS BLOCKATTN_KERNELS_SET_SELECTORS)
    string(REGEX REPLACE ":.*" "" b "${sel}")
    list(APPEND file_backends "${b}")
  endforeach()
  list(REMOVE_DUPLICATES file_backends)
  list(SORT file_backends)
  set(backends ${BLOCKATTN_BACKENDS})
  list(SORT backends)
  if(NOT file_backends STREQUAL backends)
    message(STATUS "BlockAttn: kernels_set_matches_tests not added: ${BLOCKATTN_KERNELS_SET_FILE} "
                   "is for the backends ${file_backends}, this Kokkos has ${backends}")
    return()
  endif()
  add_test(NAME kernels_set_matches_tests
           COMMAND sh ${PROJECT_SOURCE_DIR}/tests/kernels_used.sh check
                   ${PROJECT_BINARY_DIR}/kernels/objects_linking_kernels.txt
                   ${BLOCKATTN_KERNELS_SET_FILE})
  set_tests_properties(kernels_set_matches_tests PROPERTIES LABELS "compile")
endfunction()
