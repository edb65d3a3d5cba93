// A short program using only the public headers: load a model, save per-token states and
// write betas ("skip token 2"), then check the state after token 2 equals the state after token 1.
#include <cmath>
#include <cstdio>

#include "mixlens/errors.h"
#include "mixlens/model.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
    return 2;
  }
  try {
    mixlens::Model model = mixlens::Model::load(argv[1]);
    const auto ids = model.tokenizer().encode("Once upon a time, there was a little girl");
    std::printf("family %s, %d layers, prompt of %zu tokens\n", model.info().family.c_str(), model.info().num_layers,
                ids.size());

    mixlens::Trace trace;
    trace.save("layers.0.linear_attn.states").save("logits");
    trace.edit("layers.0.linear_attn.betas", [](mixlens::Tensor& betas, const mixlens::SiteContext&) {
      const int64_t T = betas.size(1), H = betas.size(2);
      if (T > 2)
        for (int64_t h = 0; h < H; ++h) betas[2 * H + h] = 0.0f;  // token 2 writes and decays nothing
    });
    model.run({ids}, &trace);

    const mixlens::Tensor& states = trace.get("layers.0.linear_attn.states");  // [1, T, H, N, P]
    const int64_t per_token = states.numel() / states.size(1);
    double diff = 0.0;
    for (int64_t i = 0; i < per_token; ++i) diff = std::fmax(diff, std::fabs(states[2 * per_token + i] - states[per_token + i]));
    std::printf("states %s; max |state after token 2 - state after token 1| = %g\n",
                mixlens::shape_str(states.shape()).c_str(), diff);

    mixlens::GenerateOptions opts;
    opts.max_new_tokens = 12;
    auto out = model.generate({ids}, opts);
    std::printf("greedy continuation: %s\n", model.tokenizer().decode(out.new_tokens[0]).c_str());
    return diff < 1e-6 ? 0 : 1;
  } catch (const mixlens::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
