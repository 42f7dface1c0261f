//! The channel calibration Double Sparsity needs: read from the model's folder, or from a
//! folder of calibrations kept outside model folders (the window's: Folio's home), because
//! model folders may be read-only or a source tree.

use super::Engine;
use crate::attention;
use crate::calibrate;
use crate::error::{Error, Result};

impl Engine {
    /// What `methods` need from this model's folder: the channel calibration, loaded only
    /// when one of them needs it (its absence is then an error naming `folio calibrate`).
    pub fn resources(&self, methods: &[attention::MethodChoice]) -> Result<attention::Resources> {
        let mut resources = attention::Resources::default();
        if methods.iter().map(|m| m.spec()).collect::<Result<Vec<_>>>()?.iter().any(|s| s.needs.calibration) {
            let calibration = calibrate::Calibration::load(&self.calibration_source()?, self.stamp()?)?;
            resources.channels = Some(std::sync::Arc::new(calibration.channels));
        }
        Ok(resources)
    }

    /// Keeps calibrations made for this model under `dir` (one folder per model fingerprint)
    /// besides its own folder; the first call wins.
    pub fn keep_calibrations_in(&self, dir: std::path::PathBuf) {
        let _ = self.calibrations.set(dir);
    }

    /// Where a calibration made now for this model is written: the calibrations folder's
    /// folder for its fingerprint when one is set (model folders may be read-only, or a
    /// source tree), else the model's folder (`folio calibrate`).
    pub fn calibration_dir(&self) -> Result<std::path::PathBuf> {
        match self.calibrations.get() {
            Some(dir) => {
                let name = self.stamp()?.name.replace(['/', '\\'], "_");
                Ok(dir.join(format!("{name}-{}", self.fingerprint_id()?)))
            }
            None => Ok(self.model_dir().to_owned()),
        }
    }

    /// A short id of the model's fingerprint (its weights and tokenizer): what files measured
    /// on this model (a calibration's folder, answer costs) are tied to.
    pub fn fingerprint_id(&self) -> Result<String> {
        let id = serde_json::to_vec(&self.stamp()?.fingerprint).map_err(|e| Error::Invalid(e.to_string()))?;
        Ok(folio_context_file::format::checksum(&id))
    }

    /// The folder the calibration is read from: the model's when it holds one for this model,
    /// else the calibrations folder's when it holds one (else the model's: its error names it).
    pub fn calibration_source(&self) -> Result<std::path::PathBuf> {
        let own = self.model_dir();
        let kept = self.calibration_dir()?;
        // The model's own when it loads for this model; else the kept one when there is one.
        if calibrate::Calibration::load(own, self.stamp()?).is_ok() || !calibrate::Calibration::path(&kept).is_file() {
            return Ok(own.to_owned());
        }
        Ok(kept)
    }
}
