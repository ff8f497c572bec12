//! Loading: figment merges the built-in defaults, the TOML file and the
//! `CONDENSE_*` variables (`env`) into the raw [`Config`], then
//! [`Config::validate`] checks it.

use std::path::Path;

use figment::Figment;
use figment::providers::{Format, Serialized, Toml};

use super::{Config, ConfigError, DEFAULT_CONFIG_PATH, Secret, env};

impl Config {
    /// Loads the layered configuration. `path` is an explicit `--config`; it
    /// must exist. Without it, `config/condense.toml` is read if present.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        match path {
            Some(p) if !p.exists() => return Err(ConfigError::MissingFile(p.to_path_buf())),
            Some(p) => figment = figment.merge(Toml::file_exact(p)),
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
                figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_PATH))
            }
            None => {}
        }
        let mut config: Config = figment.merge(env::provider()).extract()?;
        config.unset_empty();
        config.validate()?;
        Ok(config)
    }

    /// Parses one TOML document over the defaults, without the environment.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()?;
        config.unset_empty();
        config.validate()?;
        Ok(config)
    }

    /// An optional key set to an empty string is unset (so a Compose file
    /// or a Kubernetes manifest can pass `CONDENSE_UPSTREAM__API_KEY=` through
    /// from an environment that may not have it).
    fn unset_empty(&mut self) {
        let secret = |s: &mut Option<Secret>| {
            if s.as_ref().is_some_and(|k| k.expose().is_empty()) {
                *s = None;
            }
        };
        secret(&mut self.upstream.api_key);
        secret(&mut self.upstream.anthropic_api_key);
        secret(&mut self.summary.api_key);
        secret(&mut self.state.redis_url);
        for s in [&mut self.summary.base_url, &mut self.summary.model] {
            if s.as_ref().is_some_and(String::is_empty) {
                *s = None;
            }
        }
        if self
            .upstream
            .ca_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            self.upstream.ca_file = None;
        }
    }
}
