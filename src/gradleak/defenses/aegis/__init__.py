"""Aegis (paper 000): the defense (:mod:`.defense`), its synthetic cache (:mod:`.cache`) and the conditional
generators that fill it (:mod:`.generators`, registered in :data:`gradleak.registry.GENERATORS`)."""
