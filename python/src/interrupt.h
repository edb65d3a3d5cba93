// Ctrl-C while Python waits in C++: the caller blocks with the GIL released, so Python's signal
// handler cannot run until C++ returns. These helpers poll PyErr_CheckSignals about every 50 ms,
// stop the forward through its cancellation flag and raise the KeyboardInterrupt (issue 11).
#pragma once
#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

namespace mixlens::py {

namespace nb = nanobind;

/// Throws nb::python_error (KeyboardInterrupt, or whatever the handler raised) when a signal is
/// pending. Takes the GIL; call it with the GIL released.
inline void check_signals() {
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw nb::python_error();
}

/// Runs `work(&cancel)` on a helper thread while the calling (Python) thread waits with the GIL
/// released; on a signal it sets `cancel` (the forward stops at its next layer), joins the helper
/// and raises the signal's exception. Needs the GIL on entry; returns work's result or rethrows
/// its error.
template <class R, class F>
R run_interruptible(F&& work) {
  std::atomic<bool> cancel{false};
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<R> result;
  std::exception_ptr error;
  std::optional<nb::python_error> signal;
  {
    nb::gil_scoped_release release;
    std::thread helper([&] {
      try {
        result.emplace(work(&cancel));
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu);
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::milliseconds(50), [&] { return done; })) {
      lk.unlock();
      try {
        check_signals();
      } catch (nb::python_error& e) {
        signal.emplace(std::move(e));
        cancel.store(true);
      }
      lk.lock();
      if (signal) {
        cv.wait(lk, [&] { return done; });
        break;
      }
    }
    lk.unlock();
    helper.join();
  }
  if (signal) throw std::move(*signal);
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

}  // namespace mixlens::py
