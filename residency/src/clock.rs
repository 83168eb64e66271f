//! Time as the residency cache sees it: real for runs, virtual for simulations and tests.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A monotonic clock measured from an arbitrary origin.
pub trait Clock: Send + Sync {
    fn now(&self) -> Duration;
}

/// Wall-clock time since creation.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to: simulations advance it event by event, so their
/// results do not depend on the machine's speed or load.
#[derive(Debug, Default)]
pub struct VirtualClock {
    now: Mutex<Duration>,
}

impl VirtualClock {
    pub fn new() -> VirtualClock {
        VirtualClock::default()
    }

    /// Moves the clock to `t`; time never goes backwards.
    pub fn advance_to(&self, t: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        if t > *now {
            *now = t;
        }
    }

    pub fn advance_by(&self, d: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now += d;
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Duration {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}
