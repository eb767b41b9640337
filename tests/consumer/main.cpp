// A consumer's program: with identical keys every query weighs all values
// equally, so O is the mean of V (and LSE = log(Nk) + the common logit).
#include <blockattn/blockattn.hpp>

#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  Kokkos::initialize(argc, argv);
  int failures = 0;
  {
    const int b = 1, n = 100, h = 2, d = 64;
    Kokkos::View<double****> q("q", b, n, h, d), k("k", b, n, h, d), v("v", b, n, h, d),
        o("o", b, n, h, d);
    Kokkos::View<double***> lse("lse", b, h, n);
    Kokkos::deep_copy(q, 0.5);
    Kokkos::deep_copy(k, 0.25);
    auto vh = Kokkos::create_mirror_view(v);
    for (int j = 0; j < n; ++j)
      for (int x = 0; x < h; ++x)
        for (int c = 0; c < d; ++c) vh(0, j, x, c) = j;  // mean over keys = (n - 1) / 2
    Kokkos::deep_copy(v, vh);
    blockattn::attention_forward(q, k, v, o, lse);
    auto oh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o);
    auto lh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), lse);
    const double logit = 0.5 * 0.25 * d / std::sqrt(double(d));
    for (int i = 0; i < n; ++i)
      for (int x = 0; x < h; ++x) {
        if (std::abs(oh(0, i, x, 0) - (n - 1) / 2.0) > 1e-12) ++failures;
        if (std::abs(lh(0, x, i) - (std::log(double(n)) + logit)) > 1e-12) ++failures;
      }
    std::printf("consumer: Kokkos %d, %s, %d failures\n", KOKKOS_VERSION,
                Kokkos::DefaultExecutionSpace::name(), failures);
  }
  Kokkos::finalize();
  return failures == 0 ? 0 : 1;
}
