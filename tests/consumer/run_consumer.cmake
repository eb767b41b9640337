# Installs BlockAttn from BUILD_DIR into a fresh prefix, then builds and runs the
# consumer project against it (find_package) and against SOURCE_DIR (add_subdirectory).
foreach(var SOURCE_DIR BUILD_DIR WORK_DIR KOKKOS_DIR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()

function(consumer mode kokkos_dir tag)
  set(bdir ${WORK_DIR}/${mode}-${tag})
  # BlockAttn::kernels was compiled against the main Kokkos: only with it.
  set(kernels OFF)
  if(mode STREQUAL "package" AND tag STREQUAL "main")
    set(kernels ON)
  endif()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${bdir}
      -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release
      # The package's flags and targets are under test, not the speed of its
      # small programs: -O0 (this test runs alone in ctest: 42 s against 49 s
      # at -O1 on 2 cores).
      "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG"
      -DCONSUMER_MODE=${mode} -DBLOCKATTN_SOURCE_DIR=${SOURCE_DIR}
      -DCONSUMER_KERNELS=${kernels}
      -DCMAKE_PREFIX_PATH=${prefix} -DKokkos_DIR=${kokkos_dir})
  run(${CMAKE_COMMAND} --build ${bdir} -j 2)
  run(${bdir}/consumer)
  if(EXISTS ${bdir}/consumer_mpi)
    run(${bdir}/consumer_mpi)
  endif()
  if(kernels)
    if(NOT EXISTS ${bdir}/consumer_kernels)
      message(FATAL_ERROR "the installed package has no BlockAttn::kernels")
    endif()
    run(${bdir}/consumer_kernels)
  endif()
  message("consumer (${mode}, Kokkos from ${kokkos_dir}): OK")
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The planner CLI is installed with the package (where the tree builds the
# tools) and runs from the prefix: its run path finds the libraries it links.
if(EXISTS ${BUILD_DIR}/tools/blockattn_plan)
  if(NOT EXISTS ${prefix}/bin/blockattn_plan)
    message(FATAL_ERROR "cmake --install put no bin/blockattn_plan into ${prefix}")
  endif()
  run(${prefix}/bin/blockattn_plan --n 65536 --p 8 --hw a100-nvlink)
endif()
consumer(package ${KOKKOS_DIR} main)
consumer(subdirectory ${KOKKOS_DIR} main)
if(EXTRA_KOKKOS_DIR)
  consumer(package ${EXTRA_KOKKOS_DIR} extra)
endif()
