"""The recorded tape, the engine's bottom layer: op-callback recording of
the ops run or built while a tape is active (`recording`: `Entry`,
`Recorder`, the op views gradient functions read), the side effects the
recording itself must not have (`side_effects`), loops and nested
functions made visible to the tape (`control_flow`), and library constants
traced once (`library_constants`). The tape API on top of the
engine is `tf_pxg.gradient_tape.GradientTape` (`tf_pxg.GradientTape`)."""
