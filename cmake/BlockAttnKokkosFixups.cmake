# Repairs known-broken Kokkos package files, after find_package(Kokkos).
#
# Debian 12's libtrilinos-kokkos-dev (Trilinos 13.2, TriBITS) computes the
# prefix of its Kokkos::kokkos target one directory short of its multiarch
# install path, so the target's include directory is /usr/lib/include, which
# does not exist; its Kokkos_INCLUDE_DIRS variable is right. When every include
# directory of the target is missing and Kokkos_INCLUDE_DIRS exists, use it.
if(TARGET Kokkos::kokkos AND Kokkos_INCLUDE_DIRS)
  get_target_property(_blockattn_kokkos_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
  set(_blockattn_kokkos_inc_ok FALSE)
  foreach(_dir IN LISTS _blockattn_kokkos_inc)
    if(_dir MATCHES "^\\$<" OR EXISTS "${_dir}")
      set(_blockattn_kokkos_inc_ok TRUE)
    endif()
  endforeach()
  if(NOT _blockattn_kokkos_inc_ok)
    set_target_properties(Kokkos::kokkos PROPERTIES
                          INTERFACE_INCLUDE_DIRECTORIES "${Kokkos_INCLUDE_DIRS}")
  endif()
endif()
