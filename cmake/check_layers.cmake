# The folder layout is the layer order: a header includes headers of its own
# layer or of layers below it, and a layer's impl/ headers only from that layer.
#   cmake -DINCLUDE_DIR=<repo>/include -P cmake/check_layers.cmake
# (ctest: layers). Layers, from the bottom:
#   core (config, errors) < policy (masks, partitions, positions)
#   < kernel (single-device kernels, tiles) and comm (communicators)
#   < schedule (descriptions) < distributed (the step loops) and plan (planner)
#   < the top level (blockattn.hpp and the headers with extra dependencies)
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)
set(_rank_core 0)
set(_rank_policy 1)
set(_rank_kernel 2)
set(_rank_comm 2)
set(_rank_schedule 3)
set(_rank_distributed 4)
set(_rank_plan 4)
set(_rank_top 5)

# Inside kernel/, the same rule by folder: the public vocabulary (options,
# sinks, ISA, tile shapes, band pieces, the fused-call types) < impl/ (what
# several backends share: packed blocks, the softmax state, conversions)
# < the backends, each in the folder of where it runs: host/ (x86 micro
# kernels, AMX, AVX512-BF16), cuda/ (the tensor-core kernels), cudnn/
# (cuDNN and its emulation), portable/ (the Kokkos team kernels, which take
# the host/ micro kernels on host spaces), invariant/ (the invariant mode's
# passes: the distributed and serving drivers call them directly, as the
# mode has its own two-pass schedule) < the seam (block_product.hpp,
# instantiate.hpp, portable_call.hpp, then dispatch.hpp: the one place that
# chooses an implementation) < the entry points. A backend includes no other backend
# (portable/ only host/), and nothing runs back up.
set(_ba_kernel_seam block_product:4 instantiate:5 portable_call:6 dispatch:7
                    attention_forward:8 attention_backward:9 decode:8 decode_paged:9
                    decode_quantized:9)
function(_kernel_rank path out_rank out_group)  # path relative to include/blockattn/kernel
  if(path MATCHES "^(impl)/")
    set(r 1)
    set(g impl)
  elseif(path MATCHES "^(host|cuda|cudnn)/")
    set(r 2)
    set(g ${CMAKE_MATCH_1})
  elseif(path MATCHES "^(portable|invariant)/")
    set(r 3)
    set(g ${CMAKE_MATCH_1})
  else()
    string(REGEX REPLACE "\\.hpp$" "" stem "${path}")
    set(r 0)
    set(g vocabulary)
    foreach(entry IN LISTS _ba_kernel_seam)
      string(REPLACE ":" ";" pair "${entry}")
      list(GET pair 0 name)
      list(GET pair 1 rank)
      if(stem STREQUAL name)
        set(r ${rank})
        set(g ${name})
      endif()
    endforeach()
  endif()
  set(${out_rank} ${r} PARENT_SCOPE)
  set(${out_group} ${g} PARENT_SCOPE)
endfunction()

function(_layer_of path out)  # path relative to include/blockattn
  if(path MATCHES "^([a-z]+)/")
    set(${out} ${CMAKE_MATCH_1} PARENT_SCOPE)
  else()
    set(${out} top PARENT_SCOPE)
  endif()
endfunction()

file(GLOB_RECURSE _headers RELATIVE ${INCLUDE_DIR}/blockattn ${INCLUDE_DIR}/blockattn/*.hpp)
set(_errors "")
set(_edges 0)
foreach(h IN LISTS _headers)
  _layer_of(${h} lh)
  if(NOT DEFINED _rank_${lh})
    string(APPEND _errors "  ${h}: folder '${lh}' is not a known layer\n")
    continue()
  endif()
  file(STRINGS ${INCLUDE_DIR}/blockattn/${h} _incs REGEX "^#include <blockattn/")
  foreach(line IN LISTS _incs)
    string(REGEX REPLACE "^#include <blockattn/([^>]+)>.*" "\\1" d "${line}")
    math(EXPR _edges "${_edges} + 1")
    if(NOT EXISTS ${INCLUDE_DIR}/blockattn/${d})
      string(APPEND _errors "  ${h} includes blockattn/${d}, which does not exist\n")
      continue()
    endif()
    _layer_of(${d} ld)
    if(d MATCHES "^[a-z]+/impl/|^kernel/(host|cuda|cudnn|portable)/" AND NOT lh STREQUAL ld)
      string(APPEND _errors "  ${h} (${lh}) includes blockattn/${d}: another layer's impl/\n")
    elseif(NOT lh STREQUAL ld AND NOT _rank_${ld} LESS _rank_${lh})
      string(APPEND _errors "  ${h} (${lh}) includes blockattn/${d} (${ld}): not a lower layer\n")
    elseif(lh STREQUAL "kernel" AND ld STREQUAL "kernel")
      string(REGEX REPLACE "^kernel/" "" hk "${h}")
      string(REGEX REPLACE "^kernel/" "" dk "${d}")
      _kernel_rank(${hk} rh gh)
      _kernel_rank(${dk} rd gd)
      set(_ok FALSE)
      if(gh STREQUAL gd)  # the same folder, or the same vocabulary
        set(_ok TRUE)
      elseif(rd LESS rh AND NOT (rh EQUAL 3 AND gd MATCHES "^(cuda|cudnn)$"))
        set(_ok TRUE)
      endif()
      if(gh STREQUAL "vocabulary" AND NOT gd STREQUAL "vocabulary")
        set(_ok FALSE)
      endif()
      if(NOT _ok)
        string(APPEND _errors "  ${h} (kernel/${gh}) includes blockattn/${d} (kernel/${gd}): "
                              "not below it in kernel/ (a backend includes no other backend; "
                              "portable/ takes host/ only)\n")
      endif()
    endif()
  endforeach()
endforeach()
# The kernel layer's seam: no name declared in kernel/impl/ is used outside
# kernel/ (the layers above call the block product, kernel/block_product.hpp).
# Namespace-scope declarations start in column 0 in this code base.
set(_impl_names "")
file(GLOB _kernel_impl ${INCLUDE_DIR}/blockattn/kernel/impl/*.hpp
     ${INCLUDE_DIR}/blockattn/kernel/host/*.hpp ${INCLUDE_DIR}/blockattn/kernel/portable/*.hpp
     ${INCLUDE_DIR}/blockattn/kernel/cuda/*.hpp ${INCLUDE_DIR}/blockattn/kernel/cudnn/*.hpp)
foreach(f IN LISTS _kernel_impl)
  file(STRINGS ${f} _decls REGEX "^([A-Za-z_].*[ *&]|)[A-Za-z_][A-Za-z_0-9]*( =|\\(| {|;|$)")
  foreach(line IN LISTS _decls)
    if(line MATCHES "^(#|//|namespace|template|return|public|private|protected|}|case|default)")
      continue()
    endif()
    if(line MATCHES "^(struct|class|using|union|enum|enum class) ([A-Za-z_][A-Za-z_0-9]*)")
      list(APPEND _impl_names ${CMAKE_MATCH_2})
    elseif(line MATCHES "([A-Za-z_][A-Za-z_0-9]*)\\(")
      list(APPEND _impl_names ${CMAKE_MATCH_1})
    elseif(line MATCHES "([A-Za-z_][A-Za-z_0-9]*) =")
      list(APPEND _impl_names ${CMAKE_MATCH_1})
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES _impl_names)
list(LENGTH _impl_names _n_impl)
if(_n_impl LESS 20)
  message(FATAL_ERROR "check_layers: found only ${_n_impl} names declared in kernel/impl/")
endif()
file(GLOB_RECURSE _outside ${INCLUDE_DIR}/blockattn/*.hpp)
if(EXTRA_SOURCES)  # e.g. the benchmarks: they use the public interface only
  file(GLOB _extra ${EXTRA_SOURCES})
  list(APPEND _outside ${_extra})
endif()
foreach(f IN LISTS _outside)
  if(f MATCHES "/include/blockattn/kernel/")
    continue()
  endif()
  file(STRINGS ${f} _uses REGEX "impl::[A-Za-z_]")
  foreach(line IN LISTS _uses)
    string(REGEX MATCHALL "impl::[A-Za-z_][A-Za-z_0-9]*" _refs "${line}")
    foreach(r IN LISTS _refs)
      string(REPLACE "impl::" "" name "${r}")
      if(name IN_LIST _impl_names)
        file(RELATIVE_PATH rel ${INCLUDE_DIR}/.. ${f})
        string(APPEND _errors "  ${rel} uses impl::${name}, declared in kernel/impl/ "
                              "(use the block product, kernel/block_product.hpp)\n")
      endif()
    endforeach()
  endforeach()
endforeach()

list(LENGTH _headers _n)
if(_n LESS 10 OR _edges LESS 20)
  message(FATAL_ERROR "check_layers: found only ${_n} headers / ${_edges} includes under ${INCLUDE_DIR}")
endif()
if(_errors)
  message(FATAL_ERROR "BlockAttn layer order violated:\n${_errors}")
endif()
message(STATUS "check_layers: ${_n} headers, ${_edges} includes, layer order holds; "
               "${_n_impl} kernel/impl names stay in kernel/")
