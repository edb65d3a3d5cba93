// The next-token choice: transformers' greedy argmax and temperature -> top-k -> top-p warpers.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "runtime/sampling.h"

using namespace mixlens;
using namespace mixlens::detail;

namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f};

std::map<int32_t, int> histogram(const GenerateOptions& o, int draws, uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) ++h[sample(kLogits.data(), static_cast<int64_t>(kLogits.size()), o, rng)];
  return h;
}

TEST(Sampling, ArgmaxTakesTheFirstMaximumLikeTorch) {
  EXPECT_EQ(argmax(kLogits.data(), static_cast<int64_t>(kLogits.size())), 1);
}

TEST(Sampling, TopKOneIsGreedyAndTopKKeepsOnlyTheK) {
  GenerateOptions o;
  o.greedy = false;
  o.top_k = 1;  // ties at the threshold survive: both 3.0 logits (ids 1 and 3)
  auto h = histogram(o, 2000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_GT(h[1], 800);
  EXPECT_GT(h[3], 800);
  o.top_k = 3;
  h = histogram(o, 4000);
  for (const auto& [id, n] : h) EXPECT_TRUE(id == 1 || id == 2 || id == 3) << id;
}

TEST(Sampling, TopPDropsTheLowTail) {
  GenerateOptions o;
  o.greedy = false;
  // softmax of kLogits: ids 1 and 3 hold ~0.38 each, id 2 ~0.14; top_p 0.6 keeps exactly {1, 3}.
  o.top_p = 0.6f;
  auto h = histogram(o, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_TRUE(h.count(1) && h.count(3));
  o.top_p = 1e-6f;  // keeps at least one token (the largest)
  h = histogram(o, 500);
  EXPECT_EQ(h.size(), 1u);
}

TEST(Sampling, FrequenciesFollowTheTemperedSoftmax) {
  GenerateOptions o;
  o.greedy = false;
  o.temperature = 2.0f;
  const int draws = 40000;
  auto h = histogram(o, draws);
  double z = 0;
  for (float l : kLogits) z += std::exp(l / 2.0);
  for (size_t i = 0; i < kLogits.size(); ++i) {
    const double p = std::exp(kLogits[i] / 2.0) / z;
    const double freq = static_cast<double>(h[static_cast<int32_t>(i)]) / draws;
    EXPECT_NEAR(freq, p, 4 * std::sqrt(p * (1 - p) / draws) + 1e-3) << "id " << i;
  }
}

TEST(Sampling, SameSeedSameDraws) {
  GenerateOptions o;
  o.greedy = false;
  o.temperature = 1.5f;
  EXPECT_EQ(histogram(o, 300, 42), histogram(o, 300, 42));
  EXPECT_NE(histogram(o, 300, 42), histogram(o, 300, 43));
}

}  // namespace
