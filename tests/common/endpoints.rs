//! Reading a guard's `--metrics-addr` endpoints the way Prometheus and a kubelet would.

use std::time::Duration;

use prometheus_parse::{Scrape, Value};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into()
}

/// The status of `GET http://127.0.0.1:{port}{path}`, or `None` when nothing answers.
pub fn status(port: u16, path: &str) -> Option<u16> {
    agent()
        .get(&format!("http://127.0.0.1:{port}{path}"))
        .call()
        .ok()
        .map(|response| response.status().as_u16())
}

/// One scrape of `/metrics`, parsed by a Prometheus text parser.
pub struct Metrics(Scrape);

impl Metrics {
    pub fn scrape(port: u16) -> Option<Metrics> {
        let mut response = agent()
            .get(&format!("http://127.0.0.1:{port}/metrics"))
            .call()
            .ok()?;
        assert_eq!(response.status().as_u16(), 200);
        let text = response.body_mut().read_to_string().ok()?;
        let lines = text.lines().map(|line| Ok(line.to_owned()));
        Some(Metrics(Scrape::parse(lines).expect("valid exposition")))
    }

    /// The value of the one sample of `metric` whose labels include `labels`; panics if there is
    /// not exactly one.
    pub fn value(&self, metric: &str, labels: &[(&str, &str)]) -> f64 {
        let matching: Vec<f64> = self
            .0
            .samples
            .iter()
            .filter(|s| s.metric == metric)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .filter_map(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
                _ => None,
            })
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "{metric}{labels:?} in {:#?}",
            self.0.samples
        );
        matching[0]
    }

    /// Every sample carries the lock's name and backend, and nothing that could grow without bound.
    pub fn label_keys(&self) -> Vec<Vec<String>> {
        self.0
            .samples
            .iter()
            .map(|s| {
                let mut keys: Vec<String> = s.labels.keys().cloned().collect();
                keys.sort();
                keys
            })
            .collect()
    }
}
